// Chart axes: whole-step ticks, clock ticks that never thin to one, and a y range that reads well for flat and non-negative series.

/** Tick spacings for a step axis: 1, 2, 5, 10, 20, 50, ... (never a fraction of a step). */
export const STEP_INCRS = Array.from({ length: 10 }, (_, e) => [1, 2, 5].map((m) => m * 10 ** e)).flat();

const MIN = 60;
const HOUR = 3600;
const DAY = 86400;
/** Tick spacings for a wall-time axis, in seconds, on clock boundaries. uPlot's own jump from 1 s to
 * 5 s (a ratio of 5) leaves a run of 6-10 s a single tick on a narrow chart; no step here is more
 * than 2.5 times the last, so any span gets at least two ticks. */
export const TIME_INCRS = [
  ...[1, 2, 5, 10, 15, 30],
  ...[1, 2, 5, 10, 15, 30].map((m) => m * MIN),
  ...[1, 2, 3, 6, 12].map((h) => h * HOUR),
  ...[1, 2, 5, 7, 14, 30, 60, 120, 240, 365].map((d) => d * DAY),
];

/** The y range: a flat series (a constant lr) gets a band around its value, and a series that never
 * goes below zero never shows negative ticks. */
export function yRange(_u: unknown, min: number | null, max: number | null): [number, number] {
  if (min === null || max === null) return [0, 1];
  // flat: a constant, or one that differs only by rounding (a smoothed constant), gets a band
  const flat = max - min <= Math.max(Math.abs(min), Math.abs(max)) * 1e-9;
  const pad = flat ? Math.abs(min) * 0.1 || 1 : (max - min) * 0.05;
  const lo = min >= 0 && min - pad < 0 ? 0 : min - pad;
  return [lo, max + pad];
}

/** The y axis's width in px: room for its widest tick label (measured in the axis's font) plus the
 * tick and the gap. A fixed width cut the leading digits of wide labels ("12.7 KiB" shown for
 * 512.7 KiB); a narrow floor keeps short labels' charts aligned with each other. */
export function ySize(labels: readonly (string | null)[] | null | undefined, measure: (text: string) => number, tickAndGap = 15): number {
  const widest = Math.max(0, ...(labels ?? []).map((label) => (label ? measure(label) : 0)));
  return Math.max(48, Math.ceil(widest + tickAndGap));
}
