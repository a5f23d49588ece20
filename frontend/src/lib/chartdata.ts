// Data for the run page's charts: the series a chart reads (across ranks, or one line per rank),
// shaped as uPlot's columns [x, ...ys], then smoothed, stacked or put on a log scale as the viewer
// asked. Every function here is pure: RunDetail and Compare call them on each redraw.
import type { MetricSeries } from "../api/client";
import { alignSeries, LiveSeries, type Num } from "./data";
import type { ChartDef } from "./runview";
import { ema, positive, stack } from "./smooth";

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
const STACK_COLORS = ["#f97316", "#3b82f6", "#94a3b8"]; // exposed comm, compute, data: the timeline's colours
const FAINT = "55"; // alpha of the raw line under a smoothed one

export const RANK_BUDGET = 2000; // rows kept per rank's line (the across-rank series keeps 4,000)

export type Columns = [number[], ...Num[][]];

export interface SeriesDef {
  label: string;
  color?: string;
  dash?: number[];
  width?: number;
  fill?: string;
  points?: boolean; // dots only, no line (one value per trial, say)
}

export interface ViewOptions {
  smoothing: number; // EMA weight; 0: raw
  logY: boolean;
}

/** Load the server's aggregate (mean, min, max per step) into ``into`` as its history; wall times
 * are read from the first rank's (the aggregate has none). */
export function setHistoryFrom(into: LiveSeries, data: MetricSeries): LiveSeries {
  const agg = data.aggregate;
  const r0 = Object.values(data.ranks)[0];
  into.setHistory(agg.step, interpolate(agg.step, r0?.step ?? [], r0?.ts ?? []), agg.mean, agg.min, agg.max);
  return into;
}

/** Each rank's own series from the same response (the first ``maxRanks`` ranks). */
export function setRankHistoryFrom(into: Map<number, LiveSeries>, data: MetricSeries, maxRanks: number): void {
  for (const [rank, rs] of Object.entries(data.ranks)) {
    if (Number(rank) >= maxRanks) continue;
    const s = into.get(Number(rank)) ?? new LiveSeries(RANK_BUDGET);
    s.setHistory(rs.step, rs.ts, rs.value);
    into.set(Number(rank), s);
  }
}

/** Wall time for each step, by linear interpolation over known (step, ts) pairs. */
export function interpolate(xs: number[], knownX: number[], knownY: number[]): number[] {
  if (!knownX.length) return xs.map(() => 0);
  const out = new Array<number>(xs.length);
  let j = 0;
  for (let i = 0; i < xs.length; i++) {
    const x = xs[i] as number;
    while (j < knownX.length - 2 && (knownX[j + 1] as number) < x) j++;
    const x0 = knownX[j] as number;
    const x1 = (knownX[j + 1] ?? x0) as number;
    const y0 = knownY[j] as number;
    const y1 = (knownY[j + 1] ?? y0) as number;
    out[i] = x1 === x0 ? y0 : y0 + ((y1 - y0) * (x - x0)) / (x1 - x0);
  }
  return out;
}

/** Throughput from step time: ``numerator`` (the global batch) over each step's slowest rank's time. */
export function throughput(slowest: ArrayLike<Num>, numerator: number): Num[] {
  return Array.from(slowest, (t) => (t !== null && t !== undefined && t > 0 ? numerator / t : null));
}

/** A chart's raw columns: [x, ...ys], x being step or wall time. A band is [x, mean, min, max]. */
export function chartData(def: ChartDef, series: Map<string, LiveSeries>, time: boolean): Columns {
  const first = series.get(def.keys[0] as string);
  const width = def.kind === "band" ? 3 : def.labels.length;
  if (!first) return [[], ...Array.from({ length: width }, () => [])];
  const x = time ? first.ts.slice() : first.x.slice();
  if (def.kind === "band") return [x, first.y.slice(), first.lo.slice(), first.hi.slice()];
  if (def.throughput !== undefined) return [x, throughput(first.hi, def.throughput)];
  if (def.keys.length === 1) {
    const scale = def.scale;
    return [x, scale ? first.y.map((v) => (v === null ? null : v * scale)) : first.y.slice()];
  }
  return aligned(def.keys.map((k) => series.get(k)), time);
}

/** One line per rank in ``order`` (empty where ``ranks`` has none), on the union of their steps. */
export function rankData(ranks: Map<number, LiveSeries>, order: number[], time: boolean): Columns {
  return aligned(order.map((r) => ranks.get(r)), time);
}

function aligned(parts: (LiveSeries | undefined)[], time: boolean): Columns {
  const cols = parts.map((s) => s ?? { x: [] as number[], y: [] as Num[], ts: [] as number[] });
  const [xs, ...ys] = alignSeries(cols.map((s) => ({ x: s.x, y: s.y })));
  if (!time) return [xs, ...ys];
  const tsOf = new Map<number, number>();
  for (const s of cols) s.x.forEach((x, i) => tsOf.set(x, s.ts[i] as number));
  return [xs.map((x) => tsOf.get(x) ?? 0), ...ys];
}

export type Kind = ChartDef["kind"];

/** The drawn series for a chart of ``kind`` with these labels: with smoothing, each raw line is
 * drawn faint under its smoothed one (TensorBoard's "Value" and "Smoothed"). */
export function seriesFor(kind: Kind, labels: string[], opts: ViewOptions): SeriesDef[] {
  const smooth = opts.smoothing > 0;
  if (kind === "band") {
    const band = [
      { label: "min", color: "#93c5fd", width: 1 },
      { label: "max", color: "#93c5fd", width: 1 },
    ];
    if (!smooth) return [{ label: "mean", color: PALETTE[0], width: 2 }, ...band];
    return [{ label: "mean (raw)", color: (PALETTE[0] as string) + FAINT, width: 1 }, ...band.map((b) => ({ ...b, color: b.color + FAINT })), { label: "mean", color: PALETTE[0], width: 2 }];
  }
  if (kind === "stacked") return labels.map((label, i) => ({ label, color: STACK_COLORS[i % 3], fill: (STACK_COLORS[i % 3] as string) + "cc", width: 1 }));
  const color = (i: number) => PALETTE[i % PALETTE.length] as string;
  const lines = labels.map((label, i) => ({ label, color: color(i) }));
  if (!smooth) return lines;
  return [...labels.map((label, i) => ({ label: `${label} (raw)`, color: color(i) + FAINT, width: 1 })), ...lines.map((l) => ({ ...l, width: 2 }))];
}

/** ``base`` (chartData's or rankData's columns) as drawn: smoothed (raw kept beneath), stacked,
 * and with only positive values on a log scale. ``shown``: the values a stacked chart's legend
 * shows (each part's own, not the running sum). Columns match seriesFor's series. */
export function present(kind: Kind, base: Columns, opts: ViewOptions): { data: Columns; shown?: Num[][] } {
  const [x, ...ys] = base;
  const smooth = (col: Num[]) => ema(col, opts.smoothing);
  const onScale = (cols: Num[][]) => (opts.logY ? cols.map(positive) : cols);
  if (kind === "stacked") {
    const parts = ys.map(smooth);
    return { data: [x, ...onScale(stack(parts))], shown: [x as Num[], ...parts.slice().reverse()] };
  }
  if (!(opts.smoothing > 0)) return { data: [x, ...onScale(ys)] };
  if (kind === "band") {
    const [mean = [], lo = [], hi = []] = ys;
    return { data: [x, ...onScale([mean, lo, hi, smooth(mean)])] };
  }
  return { data: [x, ...onScale([...ys, ...ys.map(smooth)])] };
}
