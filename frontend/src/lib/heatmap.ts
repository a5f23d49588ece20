// The ranks × steps heatmap's pure parts: the colour range and scale, and the cell under a point.

export type Cells = (number | null)[][]; // [rank row][column]

/** The colour range: the 1st to 99th percentile of the cells, so one warm-up step (or one stall)
 * does not wash every other cell out to the same pale colour; values beyond take the ends. */
export function colourRange(values: Cells): [number, number] | null {
  const all: number[] = [];
  for (const row of values) for (const v of row) if (v !== null && Number.isFinite(v)) all.push(v);
  if (!all.length) return null;
  all.sort((a, b) => a - b);
  const at = (q: number) => all[Math.min(all.length - 1, Math.max(0, Math.round(q * (all.length - 1))))] as number;
  return [at(0.01), at(0.99)];
}

// Light yellow (fast) to dark red (slow): the slow ranks and steps stand out.
const STOPS: [number, number, number][] = [
  [255, 255, 204],
  [254, 217, 118],
  [253, 141, 60],
  [227, 26, 28],
  [128, 0, 38],
];
export const NO_VALUE: [number, number, number] = [238, 241, 245];

/** The cell's colour: ``v`` placed in ``range`` on the scale; no value: light grey. */
export function colour(v: number | null, range: [number, number] | null): [number, number, number] {
  if (v === null || !Number.isFinite(v) || range === null) return NO_VALUE;
  const [lo, hi] = range;
  const t = hi > lo ? Math.min(1, Math.max(0, (v - lo) / (hi - lo))) : 0;
  const x = t * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(x));
  const f = x - i;
  const a = STOPS[i] as [number, number, number];
  const b = STOPS[i + 1] as [number, number, number];
  return [0, 1, 2].map((k) => Math.round((a[k] as number) + ((b[k] as number) - (a[k] as number)) * f)) as [number, number, number];
}

/** The cell at (x, y) of a ``width`` × ``height`` drawing of ``rows`` × ``cols`` cells, or null. */
export function cellAt(x: number, y: number, width: number, height: number, rows: number, cols: number): [number, number] | null {
  if (x < 0 || y < 0 || x >= width || y >= height || !rows || !cols) return null;
  return [Math.floor((y / height) * rows), Math.floor((x / width) * cols)];
}
