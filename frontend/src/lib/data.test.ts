import { describe, expect, it } from "vitest";
import { alignSeries, LiveSeries, mean, minMaxIndices, specTable } from "./data";

describe("minMaxIndices", () => {
  it("keeps everything under the budget", () => {
    expect(minMaxIndices([3, 1, 2], 10)).toEqual([0, 1, 2]);
  });
  it("keeps the min and max of each bucket, in order, so a spike survives", () => {
    const ys = Array.from({ length: 1000 }, (_, i) => Math.sin(i / 10));
    ys[777] = 50;
    ys[123] = -50;
    const idx = minMaxIndices(ys, 100);
    expect(idx.length).toBeLessThanOrEqual(100);
    expect(idx).toContain(777);
    expect(idx).toContain(123);
    expect([...idx].sort((a, b) => a - b)).toEqual(idx);
  });
  it("skips nulls", () => {
    const idx = minMaxIndices([null, null, 1, 5, null, 2, 9, null], 4);
    expect(idx.map((i) => [null, null, 1, 5, null, 2, 9, null][i])).toEqual([1, 5, 2, 9]);
  });
});

describe("LiveSeries", () => {
  it("merges live points after the history and folds ranks into the mean", () => {
    const s = new LiveSeries();
    s.setHistory([1, 2, 3], [10, 11, 12], [1, 2, 3]);
    expect(s.add(3, 12, 99)).toBe(false); // the history already has step 3
    s.add(4, 13, 4); // rank 0
    s.add(4, 13, 6); // rank 1
    s.add(5, 14, 5);
    expect(s.x).toEqual([1, 2, 3, 4, 5]);
    expect(s.y).toEqual([1, 2, 3, 5, 5]);
    expect(s.lo[3]).toBe(4);
    expect(s.hi[3]).toBe(6);
  });
  it("keeps live rows the history does not reach when history arrives late", () => {
    const s = new LiveSeries();
    s.add(5, 1, 5);
    s.add(6, 1, 6);
    s.setHistory([1, 5], [0, 1], [1, 5]);
    expect(s.x).toEqual([1, 5, 6]);
  });
  it("stays within its budget however many points stream in", () => {
    const s = new LiveSeries(1000);
    for (let i = 1; i <= 100_000; i++) s.add(i, i, i === 54_321 ? 1e6 : Math.random());
    expect(s.length).toBeLessThanOrEqual(1000);
    expect(s.hi).toContain(1e6);
    expect(s.x[s.x.length - 1]).toBe(100_000);
  });
  it("inserts a late step in order", () => {
    const s = new LiveSeries();
    s.add(1, 1, 1);
    s.add(3, 3, 3);
    s.add(2, 2, 2);
    expect(s.x).toEqual([1, 2, 3]);
  });
});

describe("alignSeries", () => {
  it("puts several series on the union of their x, null where absent", () => {
    expect(
      alignSeries([
        { x: [1, 2, 4], y: [10, 20, 40] },
        { x: [2, 3], y: [200, 300] },
      ]),
    ).toEqual([
      [1, 2, 3, 4],
      [10, 20, null, 40],
      [null, 200, 300, null],
    ]);
  });
});

describe("compare", () => {
  it("flags spec fields that differ", () => {
    const rows = specTable([
      { a: 1, b: { c: 2 } },
      { a: 1, b: { c: 3 } },
    ]);
    expect(rows).toEqual([
      { path: "a", values: ["1", "1"], differs: false },
      { path: "b.c", values: ["2", "3"], differs: true },
    ]);
    expect(mean([1, null, 3])).toBe(2);
  });
});

describe("LiveSeries contributions", () => {
  it("counts each rank's point per live row, so a repeated delivery shows", () => {
    const s = new LiveSeries();
    s.setHistory([1, 2], [10, 11], [1, 1]);
    s.add(3, 12, 0.5);
    s.add(3, 12, 0.7);
    s.add(4, 13, 0.4);
    expect(s.x).toEqual([1, 2, 3, 4]);
    expect(s.contributions()).toEqual([0, 0, 2, 1]);
  });
});
