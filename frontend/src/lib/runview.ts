// The run page's chart model: which charts a run's metric keys give, and their columnar data.
import type { MetricSeries } from "../api/client";
import { alignSeries, type LiveSeries, type Num } from "./data";

export const BUILTIN = new Set([
  "loss",
  "lr",
  "step_time_s",
  "data_time_s",
  "samples_per_s",
  "compute_time_s",
  "comm_time_s",
  "exposed_comm_s",
]);
export const STEP_PARTS = ["step_time_s", "compute_time_s", "exposed_comm_s", "data_time_s"];

export interface ChartDef {
  id: string;
  title: string;
  keys: string[]; // metric keys it needs
  labels: string[];
  scale?: number; // multiply y (throughput: per-rank mean × world size)
  band?: boolean; // one key drawn as mean with its across-rank min and max
  unit?: string;
}

// The sampled steps' own figures (training.profile_every): one chart; the timeline card has the rest.
const TRACE_PARTS = ["prof_comm_time_s", "prof_exposed_comm_s"];

export function chartDefs(keys: string[], world: number): ChartDef[] {
  const have = new Set(keys);
  const defs: ChartDef[] = [];
  if (have.has("loss")) defs.push({ id: "loss", title: "Loss (mean over ranks, min–max band)", keys: ["loss"], labels: ["mean", "min", "max"], band: true });
  if (have.has("samples_per_s"))
    defs.push({ id: "throughput", title: "Throughput (samples/s, all ranks)", keys: ["samples_per_s"], labels: ["samples/s"], scale: world });
  const parts = STEP_PARTS.filter((k) => have.has(k));
  if (parts.length) {
    const missing = ["compute_time_s", "exposed_comm_s"].filter((k) => !have.has(k));
    const note = missing.length ? ` — not reported yet: ${missing.join(", ")}` : "";
    defs.push({ id: "steptime", title: `Step time: compute vs exposed communication (s)${note}`, keys: parts, labels: parts, unit: " s" });
  }
  const traced = TRACE_PARTS.filter((k) => have.has(k));
  if (traced.length)
    defs.push({ id: "traced", title: "Sampled steps, from the torch.profiler trace: comm vs exposed comm (s)", keys: traced, labels: traced, unit: " s" });
  for (const k of keys) {
    if (k === "loss" || k === "samples_per_s" || STEP_PARTS.includes(k) || k.startsWith("prof_")) continue;
    defs.push({ id: `key:${k}`, title: k, keys: [k], labels: [k] });
  }
  return defs;
}

/** Wall time for each step, by linear interpolation over known (step, ts) pairs. */
/** Load the server's aggregate (mean, min, max per step) into ``into`` as its history; wall times
 * are read from the first rank's (the aggregate has none). */
export function setHistoryFrom(into: LiveSeries, data: MetricSeries): LiveSeries {
  const agg = data.aggregate;
  const r0 = Object.values(data.ranks)[0];
  into.setHistory(agg.step, interpolate(agg.step, r0?.step ?? [], r0?.ts ?? []), agg.mean, agg.min, agg.max);
  return into;
}

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

/** Columnar data for one chart: [x, ...ys], x being step or wall time. */
export function chartData(def: ChartDef, series: Map<string, LiveSeries>, time: boolean): [number[], ...Num[][]] {
  const first = series.get(def.keys[0] as string);
  if (!first) return [[], ...def.labels.map(() => [])];
  if (def.band) return [time ? first.ts.slice() : first.x.slice(), first.y.slice(), first.lo.slice(), first.hi.slice()];
  if (def.keys.length === 1) {
    const y = def.scale ? first.y.map((v) => (v === null ? null : v * (def.scale as number))) : first.y.slice();
    return [time ? first.ts.slice() : first.x.slice(), y];
  }
  const parts = def.keys.map((k) => series.get(k) ?? { x: [] as number[], y: [] as Num[], ts: [] as number[] });
  const aligned = alignSeries(parts.map((s) => ({ x: s.x, y: s.y })));
  if (!time) return aligned;
  const tsOf = new Map<number, number>();
  for (const s of parts) s.x.forEach((x, i) => tsOf.set(x, s.ts[i] as number));
  const [xs, ...ys] = aligned;
  return [xs.map((x) => tsOf.get(x) ?? 0), ...ys];
}

/** Where each later attempt of a run took over, as chart markers: at its first step, or (wall-time
 * axis) when it started. The first attempt needs none. */
export function attemptMarks(
  attempts: { number: number; first_step: number | null; started_at: string | null }[],
  time: boolean,
): { x: number; label: string }[] {
  const marks = [];
  for (const a of attempts) {
    if (a.number < 2) continue;
    const x = time ? (a.started_at ? Date.parse(a.started_at) / 1000 : null) : a.first_step;
    if (x !== null && Number.isFinite(x)) marks.push({ x, label: `attempt ${a.number}` });
  }
  return marks;
}
