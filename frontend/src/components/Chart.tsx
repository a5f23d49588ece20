// A uPlot chart, created once per (series set, x mode) and fed with setData (STYLE 11).
import { useEffect, useRef } from "preact/hooks";
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import { exposeChart } from "../lib/debug";
import { fmtAxis, fmtNumber } from "../lib/format";

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

export interface SeriesDef {
  label: string;
  color?: string;
  dash?: number[];
  width?: number;
  fill?: string;
}

/** A vertical marker across the plot, e.g. where a new attempt of the run took over. */
export interface Mark {
  x: number;
  label: string;
}

export interface ChartHandle {
  plot: uPlot | null;
  setData(data: uPlot.AlignedData): void;
}

interface Props {
  title: string;
  series: SeriesDef[];
  time?: boolean; // x is wall time (seconds) rather than step
  syncKey?: string;
  height?: number;
  unit?: string;
  onZoom?: (xMin: number, xMax: number) => void;
  handle: (h: ChartHandle | null) => void;
  testId?: string;
  marks?: Mark[];
}

export function Chart({ title, series, time = false, syncKey, height = 220, unit, onZoom, handle, testId, marks }: Props) {
  const box = useRef<HTMLDivElement>(null);
  const plotRef = useRef<uPlot | null>(null);
  const zoomRef = useRef(onZoom);
  zoomRef.current = onZoom;
  const marksRef = useRef<Mark[]>(marks ?? []);
  const marksKey = (marks ?? []).map((m) => `${m.x}:${m.label}`).join("|");
  useEffect(() => {
    marksRef.current = marks ?? [];
    plotRef.current?.redraw(false, false);
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [marksKey]);
  const seriesKey = series.map((s) => s.label).join("|");

  useEffect(() => {
    const el = box.current;
    if (!el) return;
    const width = Math.max(200, el.clientWidth);
    let xTicks: string[] = []; // what the x axis last drew (read by the browser tests)
    const opts: uPlot.Options = {
      width,
      height,
      legend: { live: true },
      cursor: {
        sync: syncKey ? { key: syncKey, setSeries: false } : undefined,
        drag: { x: true, y: false, setScale: false },
      },
      scales: { x: { time } },
      axes: [
        {
          stroke: "#64748b",
          grid: { stroke: "#eef2f7" },
          ticks: { stroke: "#e2e8f0" },
          label: time ? "wall time" : "step",
          labelSize: 18,
          labelFont: "11px system-ui, sans-serif",
          values: (_u, vals) => (xTicks = vals.map((v) => (time ? fmtClockS(v) : fmtAxis(v)))),
        },
        {
          stroke: "#64748b",
          grid: { stroke: "#eef2f7" },
          ticks: { stroke: "#e2e8f0" },
          size: 60,
          values: (_u, vals) => vals.map((v) => fmtAxis(v)),
        },
      ],
      series: [
        { label: time ? "time" : "step", value: time ? undefined : (_u, v) => (v === null ? "—" : String(v)) },
        ...series.map((s, i) => ({
          label: s.label,
          stroke: s.color ?? PALETTE[i % PALETTE.length],
          width: s.width ?? 1.5,
          dash: s.dash,
          fill: s.fill,
          spanGaps: true,
          points: { show: false },
          value: (_u: uPlot, v: number | null) => (v === null ? "—" : fmtNumber(v, 4) + (unit ?? "")),
        })),
      ],
      hooks: {
        draw: [(u) => drawMarks(u, marksRef.current)],
        setSelect: [
          (u) => {
            if (u.select.width < 5) return;
            const a = u.posToVal(u.select.left, "x");
            const b = u.posToVal(u.select.left + u.select.width, "x");
            u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
            zoomRef.current?.(a, b);
          },
        ],
      },
    };
    const empty: uPlot.AlignedData = [[], ...series.map(() => [])];
    const plot = new uPlot(opts, empty, el);
    plotRef.current = plot;
    const h: ChartHandle = { plot, setData: (d) => plot.setData(d) };
    handle(h);
    if (testId) {
      exposeChart(testId, () => ({
        x: Array.from(plot.data[0] ?? []),
        min: plot.scales.x?.min ?? null,
        max: plot.scales.x?.max ?? null,
        mode: time ? "time" : "step",
        ticks: xTicks.slice(),
        marks: marksRef.current.map((m) => m.x),
      }));
    }
    const resize = new ResizeObserver(() => {
      const w = Math.max(200, el.clientWidth);
      if (Math.abs(w - plot.width) > 2) plot.setSize({ width: w, height });
    });
    resize.observe(el);
    return () => {
      resize.disconnect();
      handle(null);
      if (testId) exposeChart(testId, null);
      plotRef.current = null;
      plot.destroy();
    };
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [seriesKey, time, syncKey, height, testId]);

  return (
    <div class="chart" data-testid={testId} data-x={time ? "time" : "step"}>
      <div class="chart-title">{title}</div>
      <div ref={box} class="chart-body" />
    </div>
  );
}

/** Dashed vertical lines with a label at the top, inside the plotting area. */
function drawMarks(u: uPlot, marks: Mark[]): void {
  const { ctx, bbox } = u;
  const ratio = window.devicePixelRatio || 1;
  for (const m of marks) {
    const px = u.valToPos(m.x, "x", true);
    if (!Number.isFinite(px) || px < bbox.left || px > bbox.left + bbox.width) continue;
    ctx.save();
    ctx.strokeStyle = "#d97706";
    ctx.lineWidth = 1.5 * ratio;
    ctx.setLineDash([4 * ratio, 3 * ratio]);
    ctx.beginPath();
    ctx.moveTo(px, bbox.top);
    ctx.lineTo(px, bbox.top + bbox.height);
    ctx.stroke();
    ctx.fillStyle = "#b45309";
    ctx.font = `${11 * ratio}px system-ui, sans-serif`;
    ctx.fillText(m.label, px + 4 * ratio, bbox.top + 12 * ratio);
    ctx.restore();
  }
}

/** Unix seconds → "14:03:27" (local clock) for the wall-time axis. */
function fmtClockS(seconds: number): string {
  return new Date(seconds * 1000).toLocaleTimeString("en-GB", { hour12: false });
}
