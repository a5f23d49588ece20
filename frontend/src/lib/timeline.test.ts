import { describe, expect, it } from "vitest";
import { timelineRows, type StepTimelines } from "./timeline";

const data: StepTimelines = {
  step: 10,
  attempt: 1,
  ranks: {
    "1": {
      step: 10,
      duration_us: 2000,
      names: ["gloo:all_reduce"],
      lanes: [{ label: "thread 3", kind: "comm", spans: [[500, 1500, 0]], dropped: 0 }],
      figures: {},
    },
    "0": {
      step: 10,
      duration_us: 4000,
      names: ["aten::addmm", "gloo:all_reduce"],
      lanes: [
        { label: "thread 2", kind: "comm", spans: [[1000, 2000, 1]], dropped: 0 },
        { label: "thread 1", kind: "compute", spans: [[0, 1, 0], [2000, 1000, 0]], dropped: 4 },
      ],
      figures: {},
    },
  },
};

describe("timelineRows", () => {
  it("puts every rank on the longest rank's axis, compute lanes first", () => {
    const { rows, axisUs } = timelineRows(data);
    expect(axisUs).toBe(4000);
    expect(rows.map((r) => [r.rank, r.kind, r.label])).toEqual([
      [0, "compute", "thread 1"],
      [0, "comm", "thread 2"],
      [1, "comm", "thread 3"],
    ]);
    expect(rows[2]?.rects[0]).toMatchObject({ x: 0.125, w: 0.375, name: "gloo:all_reduce", startUs: 500, durUs: 1500 });
    expect(rows[0]?.dropped).toBe(4);
  });

  it("keeps a 1 µs span visible", () => {
    const { rows } = timelineRows(data, 0.002);
    expect(rows[0]?.rects[0]?.w).toBe(0.002);
  });
});
