import { describe, expect, it } from "vitest";
import { cellAt, colour, colourRange, NO_VALUE } from "./heatmap";

describe("colourRange", () => {
  it("spans the 1st to 99th percentile, so one warm-up step does not set the scale", () => {
    const steady = Array.from({ length: 199 }, (_, i) => 0.01 + (i % 10) * 0.001);
    const [lo, hi] = colourRange([[5.0, ...steady], [null, 0.01]]) ?? [NaN, NaN];
    expect(lo).toBeCloseTo(0.01, 6);
    expect(hi).toBeCloseTo(0.019, 6);
  });

  it("is null without values", () => {
    expect(colourRange([[null], []])).toBeNull();
  });
});

describe("colour", () => {
  it("runs light to dark over the range and clamps beyond it", () => {
    expect(colour(0, [0, 1])).toEqual([255, 255, 204]);
    expect(colour(1, [0, 1])).toEqual([128, 0, 38]);
    expect(colour(9, [0, 1])).toEqual([128, 0, 38]);
    expect(colour(0.5, [0, 1])).toEqual([253, 141, 60]);
    expect(colour(null, [0, 1])).toEqual(NO_VALUE);
    expect(colour(3, [3, 3])).toEqual([255, 255, 204]); // every cell alike
  });
});

describe("cellAt", () => {
  it("finds the rank row and step column under the pointer", () => {
    expect(cellAt(0, 0, 400, 64, 2, 100)).toEqual([0, 0]);
    expect(cellAt(399, 63, 400, 64, 2, 100)).toEqual([1, 99]);
    expect(cellAt(400, 10, 400, 64, 2, 100)).toBeNull();
  });
});
