import { describe, expect, it } from "vitest";
import { chartData, interpolate, present, rankData, seriesFor, throughput } from "./chartdata";
import { LiveSeries } from "./data";
import { chartDefs } from "./runview";
import { ema, positive, stack } from "./smooth";

describe("ema", () => {
  it("is the identity at 0 and debiased from the first point", () => {
    expect(ema([1, 2, 3], 0)).toEqual([1, 2, 3]);
    const s = ema([10, 10, 10], 0.9);
    s.forEach((v) => expect(v).toBeCloseTo(10, 10)); // no pull towards zero at the start
  });
  it("follows TensorBoard's formula and keeps gaps as gaps", () => {
    const w = 0.5;
    const got = ema([1, null, 3, Number.NaN, 5], w);
    // last = 0.5·0 + 0.5·1 = 0.5 → /(1−0.5) = 1; then 0.5·0.5 + 0.5·3 = 1.75 → /(1−0.25) = 2.333…
    expect(got[0]).toBeCloseTo(1);
    expect(got[1]).toBeNull();
    expect(got[2]).toBeCloseTo(1.75 / 0.75);
    expect(got[3]).toBeNaN();
    expect(got[4]).toBeCloseTo((0.5 * 1.75 + 0.5 * 5) / (1 - 0.125));
  });
  it("smooths noise: a smoother line varies less", () => {
    const noisy = Array.from({ length: 200 }, (_, i) => 1 + (i % 2 ? 0.5 : -0.5));
    const spread = (xs: (number | null)[]) => Math.max(...(xs.slice(50) as number[])) - Math.min(...(xs.slice(50) as number[]));
    expect(spread(ema(noisy, 0.9))).toBeLessThan(spread(noisy) / 5);
  });
});

describe("stack and log scale", () => {
  it("draws running sums, top first, gaps not breaking the sum below", () => {
    expect(stack([[1, 1], [2, null], [3, 3]])).toEqual([[6, 4], [3, 1], [1, 1]]);
  });
  it("leaves only positive values on a log axis", () => {
    expect(positive([1, 0, -2, null, 3])).toEqual([1, null, null, null, 3]);
  });
});

describe("throughput", () => {
  it("is the global batch over each step's slowest rank", () => {
    expect(throughput([0.5, 0.25, null, 0], 64)).toEqual([128, 256, null, null]);
  });
  it("reads the across-rank maximum of step time", () => {
    const s = new LiveSeries();
    s.add(1, 100, 0.1);
    s.add(1, 100, 0.2); // the slower rank decides
    const def = chartDefs(["step_time_s"], { world: 2, batch: 64, seqLen: null }).find((d) => d.id === "throughput");
    expect(chartData(def!, new Map([["step_time_s", s]]), false)).toEqual([[1], [64 / 0.2]]);
  });
  it("scales a script's reported mean by its ranks and maps x to wall time", () => {
    const s = new LiveSeries();
    s.setHistory([1, 2], [100, 101], [10, 20]);
    const [def] = chartDefs(["samples_per_s"], { world: 4, batch: null, seqLen: null });
    expect(chartData(def!, new Map([["samples_per_s", s]]), false)).toEqual([[1, 2], [40, 80]]);
    expect(chartData(def!, new Map([["samples_per_s", s]]), true)[0]).toEqual([100, 101]);
  });
  it("interpolates wall time between known steps", () => {
    expect(interpolate([1, 5, 10], [0, 10], [100, 200])).toEqual([110, 150, 200]);
  });
});

describe("present", () => {
  const base: [number[], ...(number | null)[][]] = [[1, 2, 3], [4, 4, 4]];
  it("draws the raw line faint beneath the smoothed one", () => {
    const { data } = present("lines", base, { smoothing: 0.5, logY: false });
    expect(data.length).toBe(3); // x, raw, smoothed
    expect(data[1]).toEqual([4, 4, 4]);
    const labels = seriesFor("lines", ["loss"], { smoothing: 0.5, logY: false });
    expect(labels.map((l) => l.label)).toEqual(["loss (raw)", "loss"]);
    expect(labels[0]?.color?.length).toBe(9); // with an alpha
    expect(present("lines", base, { smoothing: 0, logY: false }).data).toEqual(base);
  });
  it("keeps a band's min and max, and its legend shows a stacked chart's parts, not their sums", () => {
    const band = present("band", [[1], [2], [1], [3]], { smoothing: 0.5, logY: false }).data;
    expect(band.length).toBe(5);
    expect(seriesFor("band", [], { smoothing: 0.5, logY: false }).map((s) => s.label)).toEqual(["mean (raw)", "min", "max", "mean"]);
    const { data, shown } = present("stacked", [[1], [0.1], [0.5], [0.2]], { smoothing: 0, logY: false });
    expect(data.slice(1).map((c) => c[0])).toEqual([0.1 + 0.5 + 0.2, 0.1 + 0.5, 0.1].map((v) => expect.closeTo(v, 12)));
    expect(shown?.slice(1).map((c) => c[0])).toEqual([0.2, 0.5, 0.1]); // exposed comm, compute, data
  });
  it("lines up ranks on the union of their steps, a missing rank empty", () => {
    const r0 = new LiveSeries();
    r0.setHistory([1, 2], [10, 11], [5, 6]);
    const r1 = new LiveSeries();
    r1.setHistory([2, 3], [11, 12], [7, 8]);
    expect(rankData(new Map([[0, r0], [1, r1]]), [0, 1, 2], false)).toEqual([[1, 2, 3], [5, 6, null], [null, 7, 8], [null, null, null]]);
  });
});
