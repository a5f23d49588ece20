// A uPlot chart, created once per (series set, x mode, y scale) and fed with setData: live points never rebuild it.
import type { ComponentChildren } from "preact";
import { useEffect, useRef } from "preact/hooks";
import uPlot from "uplot";
import { STEP_INCRS, TIME_INCRS, yRange, ySize } from "../lib/axes";
import "uplot/dist/uPlot.min.css";
import { PALETTE, type SeriesDef } from "../lib/chartdata";
import type { Num } from "../lib/data";
import { exposeChart } from "../lib/debug";
import { fmtAxis, formatter } from "../lib/format";
import type { Format } from "../lib/runview";

const Y_AXIS_FONT = "12px system-ui, sans-serif";
let measuring: CanvasRenderingContext2D | null = null;

/** A tick label's width in CSS px in the y axis's font, measured on a canvas of its own (uPlot
 * caches the font it last set on its own canvas: changing that one under it would draw with ours). */
function measureAxisText(text: string): number {
  measuring ??= document.createElement("canvas").getContext("2d");
  if (!measuring) return text.length * 7;
  measuring.font = Y_AXIS_FONT;
  return measuring.measureText(text).width;
}

export { PALETTE, type SeriesDef };

/** A vertical marker across the plot, e.g. where a new attempt of the run took over. */
export interface Mark {
  x: number;
  label: string;
}

export interface ChartHandle {
  plot: uPlot | null;
  /** ``shown``: what the legend shows per series where it is not the drawn value (a stacked
   * chart draws running sums; its legend shows each part). */
  setData(data: uPlot.AlignedData, shown?: Num[][]): void;
}

interface Props {
  title: string;
  help?: string;
  series: SeriesDef[];
  time?: boolean; // x is wall time (seconds) rather than step
  xLabel?: string; // the x axis's name where x is neither (default: "step" or "wall time")
  logY?: boolean;
  format?: Format;
  syncKey?: string;
  height?: number;
  onZoom?: (xMin: number, xMax: number) => void;
  handle: (h: ChartHandle | null) => void;
  testId?: string;
  marks?: Mark[];
  /** A performance mark set once, on the animation frame after the first draw that had data: the
   * moment its pixels are on screen (benchmarks/dashboard.py reads it). */
  drawnMark?: string;
  actions?: ComponentChildren; // in the title row: downloads
}

export function Chart({
  title,
  help,
  series,
  time = false,
  xLabel,
  logY = false,
  format,
  syncKey,
  height = 220,
  onZoom,
  handle,
  testId,
  marks,
  drawnMark,
  actions,
}: Props) {
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
  const seriesKey = series.map((s) => `${s.label}:${s.color ?? ""}`).join("|");
  const shownRef = useRef<Num[][] | undefined>(undefined);

  useEffect(() => {
    const el = box.current;
    if (!el) return;
    const width = Math.max(200, el.clientWidth);
    let xTicks: string[] = []; // what the x axis last drew (read by the browser tests)
    let yTicks: string[] = []; // what the y axis last drew
    const fmt = formatter(format);
    const opts: uPlot.Options = {
      width,
      height,
      legend: { live: true },
      cursor: {
        sync: syncKey ? { key: syncKey, setSeries: false } : undefined,
        drag: { x: true, y: false, setScale: false },
      },
      scales: {
        x: { time },
        y: logY ? { distr: 3, range: (_u, min, max) => uPlot.rangeLog(min, max, 10, true) } : { range: yRange },
      },
      axes: [
        {
          stroke: "#64748b",
          grid: { stroke: "#eef2f7" },
          ticks: { stroke: "#e2e8f0" },
          label: xLabel ?? (time ? "wall time" : "step"),
          // steps are whole numbers (no 1.5 on a short run); clock labels need room not to overlap
          incrs: time ? TIME_INCRS : STEP_INCRS,
          space: time ? 70 : 50, // "00:00:00" is ~55 px at 11 px: 70 keeps labels apart without thinning a short run to one tick
          labelSize: 18,
          labelFont: "11px system-ui, sans-serif",
          values: (_u, vals) => (xTicks = vals.map((v) => (time ? fmtClockS(v) : fmtAxis(v)))),
        },
        {
          stroke: "#64748b",
          grid: { stroke: "#eef2f7" },
          ticks: { stroke: "#e2e8f0" },
          font: Y_AXIS_FONT,
          size: (_u, labels) => ySize(labels, measureAxisText),
          values: (_u, vals) => (yTicks = vals.map((v) => (v === null ? "" : fmt.axis(v)))),
        },
      ],
      series: [
        { label: xLabel ?? (time ? "time" : "step"), value: time ? undefined : (_u, v) => (v === null ? "—" : String(v)) },
        ...series.map((s, i) => ({
          label: s.label,
          stroke: s.color ?? PALETTE[i % PALETTE.length],
          width: s.width ?? 1.5,
          dash: s.dash,
          fill: s.fill,
          spanGaps: true,
          points: s.points ? { show: true, size: 7, fill: s.color ?? PALETTE[i % PALETTE.length] } : { show: false },
          paths: s.points ? () => null : undefined,
          value: (_u: uPlot, v: number | null, si: number, di: number | null) => {
            const shown = di === null ? v : (shownRef.current?.[si]?.[di] ?? v);
            return shown === null || shown === undefined ? "—" : fmt.value(shown);
          },
        })),
      ],
      hooks: {
        draw: [
          (u) => {
            drawMarks(u, marksRef.current);
            if (drawnMark && u.data[0]?.length && !performance.getEntriesByName(drawnMark).length) {
              requestAnimationFrame(() => {
                if (!performance.getEntriesByName(drawnMark).length) performance.mark(drawnMark);
              });
            }
          },
        ],
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
    const h: ChartHandle = {
      plot,
      setData: (d, shown) => {
        // Data shaped for another series set (the page's settings changed and this chart is about to
        // be rebuilt for them) would make uPlot read a column that is not there: the rebuilt chart
        // is fed on the next redraw.
        if (d.length !== plot.series.length) return;
        shownRef.current = shown;
        plot.setData(d);
      },
    };
    handle(h);
    if (testId) {
      exposeChart(testId, () => ({
        x: Array.from(plot.data[0] ?? []),
        min: plot.scales.x?.min ?? null,
        max: plot.scales.x?.max ?? null,
        mode: time ? "time" : "step",
        ticks: xTicks.slice(),
        yTicks: yTicks.slice(),
        yAxisPx: plot.bbox.left / uPlot.pxRatio, // the y axis's width: the plot starts where it ends
        yFont: Y_AXIS_FONT,
        marks: marksRef.current.map((m) => m.x),
        series: (plot.series as { label?: string }[]).slice(1).map((x) => x.label ?? ""),
        ys: plot.data.slice(1).map((col) => Array.from(col ?? [])),
        log: plot.scales.y?.distr === 3,
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
  }, [seriesKey, time, xLabel, logY, format, syncKey, height, testId]);

  return (
    <div class="chart" data-testid={testId} data-x={time ? "time" : "step"} data-log={logY ? "on" : "off"}>
      <div class="chart-head">
        <div class="chart-title" title={help}>
          {title}
          {help && <span class="muted chart-help"> — {help}</span>}
        </div>
        {actions}
      </div>
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
