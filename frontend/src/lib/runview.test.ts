import { describe, expect, it } from "vitest";
import { attemptMarks } from "./runview";

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
