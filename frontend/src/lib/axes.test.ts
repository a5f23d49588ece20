import { describe, expect, it } from "vitest";
import { STEP_INCRS, TIME_INCRS, yRange, ySize } from "./axes";

describe("chart axes", () => {
  it("steps tick in whole numbers", () => {
    expect(STEP_INCRS.every((i) => Number.isInteger(i) && i >= 1)).toBe(true);
    expect(STEP_INCRS.slice(0, 5)).toEqual([1, 2, 5, 10, 20]);
    expect(STEP_INCRS.every((v, i) => i === 0 || v > (STEP_INCRS[i - 1] as number))).toBe(true); // uPlot wants them ascending
  });
  it("clock ticks never thin a span to one tick", () => {
    expect(TIME_INCRS.every((v, i) => i === 0 || v > (TIME_INCRS[i - 1] as number))).toBe(true);
    // uPlot takes the first spacing that leaves `space` px between ticks: for a span S over W px that
    // is the first incr >= S * space / W. Any window of length S holds at least two multiples of an
    // incr <= S / 2, so every spacing after the first must be at most 2.5 x the one before it
    // (space 70 over a >= 350 px plot asks for an incr >= S / 5).
    for (let i = 1; i < TIME_INCRS.length; i++) {
      expect((TIME_INCRS[i] as number) / (TIME_INCRS[i - 1] as number)).toBeLessThanOrEqual(2.5);
    }
    const ticksFor = (span: number, px: number) => {
      const incr = TIME_INCRS.find((v) => (v * px) / span >= 70) as number;
      const start = 1_790_000_003.7; // an arbitrary clock time, not on any boundary
      return Math.floor((start + span) / incr) - Math.ceil(start / incr) + 1;
    };
    for (const span of [3, 6, 7.5, 9, 40, 700, 5000, 90_000]) expect(ticksFor(span, 370)).toBeGreaterThanOrEqual(2);
  });
  it("a constant series gets a band around it, never below zero when it is not", () => {
    const [lo, hi] = yRange(null, 0.01, 0.01);
    expect(lo).toBeCloseTo(0.009);
    expect(hi).toBeCloseTo(0.011);
    expect(yRange(null, 0, 0)).toEqual([0, 1]);
    expect(yRange(null, -2, -2)[0]).toBeCloseTo(-2.2);
    expect(yRange(null, -2, -2)[1]).toBeCloseTo(-1.8);
    // a smoothed constant differs from itself by rounding only: still flat, not noise blown up
    const [sLo, sHi] = yRange(null, 0.01, 0.01 + 1e-18);
    expect(sLo).toBeCloseTo(0.009);
    expect(sHi).toBeCloseTo(0.011);
  });
  it("a non-negative series keeps its floor at zero or above", () => {
    const [lo, hi] = yRange(null, 0.001, 5);
    expect(lo).toBe(0);
    expect(hi).toBeGreaterThan(5);
    expect(yRange(null, 10, 20)[0]).toBeCloseTo(9.5);
  });
  it("the y axis is as wide as its widest label, so no leading digit is cut", () => {
    const measure = (text: string) => text.length * 7; // 7 px a character
    expect(ySize(["0 B", "256.0 KiB", "512.7 KiB"], measure)).toBe(9 * 7 + 15); // was a fixed 64 px: "12.7 KiB" showed
    expect(ySize(["1", "2"], measure)).toBe(48); // narrow labels: the floor, charts stay aligned
    expect(ySize(null, measure)).toBe(48);
    expect(ySize(["", null, "1.5"], measure)).toBe(48);
  });
});
