import { describe, expect, it } from "vitest";
import { attemptMarks, chartDefs, MAX_KEY_CHARTS, otherKeys, type RunShape } from "./runview";

const DDP: RunShape = { world: 2, batch: 64, seqLen: null };
const EVERY = [
  "algbw_GBps", "busbw_GBps", "busbw_efficiency", "comm_bytes", "comm_fraction", "comm_time_s", "compute_time_s",
  "data_time_s", "data_wait_s", "data_copy_s", "exposed_comm_s", "first_comm_at_s", "loss", "lr", "max_rss_bytes", "param_bytes", "optimizer_state_bytes",
  "comm_bytes_all_gather", "comm_bytes_reduce_scatter", "prof_comm_time_s", "prof_compute_time_s",
  "prof_exposed_comm_s", "prof_overlap_fraction", "samples_per_s", "step_time_s", "accuracy", "gpu_util",
];

describe("attemptMarks", () => {
  const attempts = [
    { number: 1, first_step: 1, started_at: "2026-12-03T10:00:00Z" },
    { number: 2, first_step: 201, started_at: "2026-12-03T10:05:00Z" },
    { number: 3, first_step: null, started_at: null }, // placed, no step yet
  ];

  it("marks each later attempt at the step it resumed from", () => {
    expect(attemptMarks(attempts, false)).toEqual([{ x: 201, label: "attempt 2" }]);
  });

  it("marks them at their start on the wall-time axis", () => {
    expect(attemptMarks(attempts, true)).toEqual([{ x: Date.parse("2026-12-03T10:05:00Z") / 1000, label: "attempt 2" }]);
  });
});

describe("chartDefs", () => {
  it("puts every key a built-in run logs in its section, each key on one chart at most", () => {
    const defs = chartDefs(EVERY, DDP);
    const bySection = (s: string) => defs.filter((d) => d.section === s).map((d) => d.id);
    expect(bySection("training")).toEqual(["loss", "key:lr"]);
    expect(bySection("speed")).toEqual(["throughput", "steptime", "datatime"]);
    expect(bySection("communication")).toEqual(["key:comm_fraction", "comm", "key:first_comm_at_s", "busbw", "key:busbw_efficiency", "key:comm_bytes", "commkinds", "traced"]);
    expect(bySection("system")).toEqual(["key:max_rss_bytes", "key:param_bytes", "key:optimizer_state_bytes", "key:gpu_util"]);
    expect(bySection("other")).toEqual(["key:accuracy"]);
    const charted = defs.flatMap((d) => d.keys);
    expect(new Set(charted).size).toBe(charted.length - 1); // step_time_s feeds throughput and nothing else twice
  });

  it("draws each collective kind's bytes on one chart, labelled by kind", () => {
    const kinds = chartDefs(EVERY, DDP).find((d) => d.id === "commkinds");
    expect(kinds?.keys).toEqual(["comm_bytes_all_gather", "comm_bytes_reduce_scatter"]);
    expect(kinds?.labels).toEqual(["all-gather", "reduce-scatter"]);
    expect(kinds?.format).toBe("bytes");
  });

  it("stacks the step's parts bottom-up and derives throughput from the slowest rank's step time", () => {
    const defs = chartDefs(EVERY, DDP);
    const step = defs.find((d) => d.id === "steptime");
    expect(step?.kind).toBe("stacked");
    expect(step?.keys).toEqual(["data_time_s", "compute_time_s", "exposed_comm_s"]);
    expect(step?.labels).toEqual(["exposed comm", "compute", "data"]); // top first, as drawn
    const data = defs.find((d) => d.id === "datatime");
    expect(data?.keys).toEqual(["data_wait_s", "data_copy_s"]);
    expect(data?.labels).toEqual(["copy to device", "wait for batch"]);
    const thr = defs.find((d) => d.id === "throughput");
    expect(thr?.keys).toEqual(["step_time_s"]);
    expect(thr?.throughput).toBe(64);
  });

  it("says which parts of the step time are not reported yet", () => {
    const step = chartDefs(["step_time_s", "data_time_s"], DDP).find((d) => d.id === "steptime");
    expect(step?.kind).toBe("lines");
    expect(step?.title).toContain("not reported yet: compute_time_s, exposed_comm_s");
  });

  it("adds up a script's own samples/s (its batch is its own)", () => {
    const [thr] = chartDefs(["samples_per_s", "step_time_s"], { world: 4, batch: null, seqLen: null });
    expect(thr?.keys).toEqual(["samples_per_s"]);
    expect(thr?.scale).toBe(4);
  });

  it("charts the first MAX_KEY_CHARTS other keys, whatever a run logs", () => {
    const many = Array.from({ length: 1000 }, (_, i) => `k${String(i).padStart(4, "0")}`);
    const defs = chartDefs(["loss", ...many], DDP);
    expect(defs.map((d) => d.id)).toEqual(["loss", ...many.slice(0, MAX_KEY_CHARTS).map((k) => `key:${k}`)]);
    expect(otherKeys(["loss", "samples_per_s", "step_time_s", "prof_comm_time_s", "comm_bytes", "acc"])).toEqual(["acc"]);
  });
});
