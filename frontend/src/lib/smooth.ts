// Smoothing as TensorBoard does it: an exponential moving average over the points in order,
// debiased so the first points are not pulled towards zero. Gaps (null, NaN) stay gaps and do
// not reset the average.
import type { Num } from "./data";

/** EMA with `weight` in [0, 1): 0 returns the values as they are, 0.99 is very smooth. */
export function ema(values: ArrayLike<Num>, weight: number): Num[] {
  const out = new Array<Num>(values.length);
  if (!(weight > 0)) {
    for (let i = 0; i < values.length; i++) out[i] = values[i] ?? null;
    return out;
  }
  const w = Math.min(weight, 0.999);
  let last = 0;
  let n = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v === null || v === undefined || !Number.isFinite(v)) {
      out[i] = v ?? null;
      continue;
    }
    last = last * w + (1 - w) * v;
    n++;
    out[i] = last / (1 - w ** n); // debiased: the average of what it has seen so far
  }
  return out;
}

/** Values a log-scale axis can draw: zero and negative values become gaps. */
export function positive(values: ArrayLike<Num>): Num[] {
  return Array.from(values, (v) => (v !== null && v !== undefined && v > 0 ? v : null));
}

/** Running sums of parts drawn stacked, top part first (as uPlot paints them: last on top). */
export function stack(parts: Num[][]): Num[][] {
  const sums: Num[][] = [];
  let below: Num[] | null = null;
  for (const part of parts) {
    const under: Num[] | null = below;
    const sum: Num[] = part.map((v, i): Num => {
      const b: Num = under ? (under[i] ?? null) : 0;
      if (b === null) return v ?? null;
      return v === null || v === undefined ? b : b + v;
    });
    sums.push(sum);
    below = sum;
  }
  return sums.reverse();
}
