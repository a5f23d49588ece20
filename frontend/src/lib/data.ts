// Data shaping for the charts: min/max decimation (the server's rule, so a spike survives),
// merging a downsampled history with live points, aligning several series on one x axis.

export type Num = number | null;

/**
 * Keeps, per bucket of consecutive points, the rows with the minimum and the maximum of
 * `lead` (the other columns ride along), in x order: at most `maxPoints` rows.
 */
export function minMaxIndices(lead: ArrayLike<Num>, maxPoints: number): number[] {
  const n = lead.length;
  if (n <= maxPoints || maxPoints < 2) return Array.from({ length: n }, (_, i) => i);
  const buckets = Math.floor(maxPoints / 2);
  const keep: number[] = [];
  for (let b = 0; b < buckets; b++) {
    const lo = Math.floor((b * n) / buckets);
    const hi = Math.floor(((b + 1) * n) / buckets);
    if (hi <= lo) continue;
    let iMin = -1;
    let iMax = -1;
    for (let i = lo; i < hi; i++) {
      const v = lead[i];
      if (v === null || v === undefined || Number.isNaN(v)) continue;
      if (iMin < 0 || v < (lead[iMin] as number)) iMin = i;
      if (iMax < 0 || v > (lead[iMax] as number)) iMax = i;
    }
    if (iMin < 0) {
      keep.push(lo);
      continue;
    }
    if (iMin === iMax) keep.push(iMin);
    else keep.push(Math.min(iMin, iMax), Math.max(iMin, iMax));
  }
  return keep;
}

export function pick<T>(column: ArrayLike<T>, idx: number[]): T[] {
  return idx.map((i) => column[i] as T);
}

/**
 * A chart's series: x values (step), wall time per x, and named y columns, kept sorted by x.
 * History comes from the server (already downsampled); live points are appended or, for a step
 * another rank already reported, folded into the mean. Past `budget` rows the whole series is
 * decimated again by min/max, so memory stays bounded however long the run streams.
 */
export class LiveSeries {
  x: number[] = [];
  ts: number[] = [];
  y: Num[] = [];
  lo: Num[] = [];
  hi: Num[] = [];
  private n: number[] = []; // live contributions per row (0 for history rows)
  private tail = new Map<number, number>(); // step → row, for live rows only
  /** Steps up to this came from the server; later live points for them are ignored. */
  historyUntil = -Infinity;

  constructor(public budget = 4000) {}

  setHistory(x: number[], ts: number[], y: Num[], lo?: Num[], hi?: Num[]): void {
    // Keep live rows the history does not reach yet.
    const keepFrom = this.x.findIndex((s) => s > (x.length ? (x[x.length - 1] as number) : -Infinity));
    const liveX = keepFrom < 0 ? [] : this.x.slice(keepFrom);
    const liveTs = keepFrom < 0 ? [] : this.ts.slice(keepFrom);
    const liveY = keepFrom < 0 ? [] : this.y.slice(keepFrom);
    const liveLo = keepFrom < 0 ? [] : this.lo.slice(keepFrom);
    const liveHi = keepFrom < 0 ? [] : this.hi.slice(keepFrom);
    const liveN = keepFrom < 0 ? [] : this.n.slice(keepFrom);
    this.x = [...x, ...liveX];
    this.ts = [...ts, ...liveTs];
    this.y = [...y, ...liveY];
    this.lo = [...(lo ?? y), ...liveLo];
    this.hi = [...(hi ?? y), ...liveHi];
    this.n = [...x.map(() => 0), ...liveN];
    this.historyUntil = x.length ? (x[x.length - 1] as number) : -Infinity;
    this.reindex();
  }

  /** One rank's value at one step. Returns false when the point was ignored. */
  add(step: number, ts: number, value: Num): boolean {
    if (step <= this.historyUntil) return false;
    const row = this.tail.get(step);
    if (row !== undefined) {
      const k = this.n[row] as number;
      const prev = this.y[row];
      if (value !== null) {
        this.y[row] = prev === null || prev === undefined ? value : (prev * k + value) / (k + 1);
        this.lo[row] = Math.min(this.lo[row] ?? value, value);
        this.hi[row] = Math.max(this.hi[row] ?? value, value);
      }
      this.n[row] = k + 1;
      return true;
    }
    const last = this.x.length ? (this.x[this.x.length - 1] as number) : -Infinity;
    if (step < last) return this.insert(step, ts, value);
    this.x.push(step);
    this.ts.push(ts);
    this.y.push(value);
    this.lo.push(value);
    this.hi.push(value);
    this.n.push(1);
    this.tail.set(step, this.x.length - 1);
    if (this.x.length > this.budget) this.compact(Math.floor(this.budget / 2));
    return true;
  }

  private insert(step: number, ts: number, value: Num): boolean {
    let i = this.x.length;
    while (i > 0 && (this.x[i - 1] as number) > step) i--;
    this.x.splice(i, 0, step);
    this.ts.splice(i, 0, ts);
    this.y.splice(i, 0, value);
    this.lo.splice(i, 0, value);
    this.hi.splice(i, 0, value);
    this.n.splice(i, 0, 1);
    this.reindex();
    return true;
  }

  /** Min/max decimation of everything to about `target` rows (on the max column). */
  compact(target: number): void {
    const idx = minMaxIndices(this.hi, target);
    this.x = pick(this.x, idx);
    this.ts = pick(this.ts, idx);
    this.y = pick(this.y, idx);
    this.lo = pick(this.lo, idx);
    this.hi = pick(this.hi, idx);
    // A decimated row no longer stands for one step: it takes no more live contributions,
    // except the newest, whose other ranks are probably still on their way.
    this.n = pick(this.n, idx);
    this.tail.clear();
    const lastRow = this.x.length - 1;
    if (lastRow >= 0) this.tail.set(this.x[lastRow] as number, lastRow);
  }

  private reindex(): void {
    this.tail.clear();
    this.n.forEach((k, row) => {
      if (k > 0) this.tail.set(this.x[row] as number, row);
    });
  }

  /** Live contributions per row (0 for history rows): one per rank that reported the step. */
  contributions(): number[] {
    return this.n.slice();
  }

  get length(): number {
    return this.x.length;
  }
}

/**
 * Several series on one x axis (uPlot's columnar [xs, ...ys]): the sorted union of their x,
 * each y null where that series has no point.
 */
export function alignSeries(series: { x: ArrayLike<number>; y: ArrayLike<Num> }[]): [number[], ...Num[][]] {
  const all = new Set<number>();
  for (const s of series) for (let i = 0; i < s.x.length; i++) all.add(s.x[i] as number);
  const xs = [...all].sort((a, b) => a - b);
  const pos = new Map<number, number>();
  xs.forEach((x, i) => pos.set(x, i));
  const ys = series.map((s) => {
    const col: Num[] = new Array<Num>(xs.length).fill(null);
    for (let i = 0; i < s.x.length; i++) col[pos.get(s.x[i] as number) as number] = s.y[i] ?? null;
    return col;
  });
  return [xs, ...ys];
}

/** Mean of the non-null values, or null. */
export function mean(values: ArrayLike<Num>): number | null {
  let sum = 0;
  let k = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v !== null && v !== undefined && Number.isFinite(v)) {
      sum += v;
      k++;
    }
  }
  return k ? sum / k : null;
}

export function lastValue(values: ArrayLike<Num>): number | null {
  for (let i = values.length - 1; i >= 0; i--) {
    const v = values[i];
    if (v !== null && v !== undefined) return v;
  }
  return null;
}

/** Spec differences for compare: every leaf path whose values are not all equal. */
export function flatten(obj: unknown, prefix = ""): Record<string, string> {
  const out: Record<string, string> = {};
  if (obj !== null && typeof obj === "object" && !Array.isArray(obj)) {
    for (const [k, v] of Object.entries(obj as Record<string, unknown>)) {
      Object.assign(out, flatten(v, prefix ? `${prefix}.${k}` : k));
    }
  } else {
    out[prefix] = JSON.stringify(obj);
  }
  return out;
}

export function specTable(specs: unknown[]): { path: string; values: (string | undefined)[]; differs: boolean }[] {
  const flat = specs.map((s) => flatten(s));
  const paths = [...new Set(flat.flatMap((f) => Object.keys(f)))].sort();
  return paths.map((path) => {
    const values = flat.map((f) => f[path]);
    return { path, values, differs: new Set(values).size > 1 };
  });
}
