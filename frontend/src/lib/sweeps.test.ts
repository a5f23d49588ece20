import { describe, expect, it } from "vitest";
import { axisPos, bestSoFar, fmtParams, paramAxes, parseChoices, sortErrors, spaceOf, trialBadge, valueAxis } from "./sweeps";

describe("sweeps", () => {
  it("keeps the best complete value so far, in trial order, ignoring pruned and failed trials", () => {
    const trials = [
      { number: 1, state: "pruned", value: null },
      { number: 0, state: "complete", value: 2.0 },
      { number: 2, state: "complete", value: 1.5 },
      { number: 3, state: "complete", value: 1.7 },
      { number: 4, state: "failed" },
    ];
    expect(bestSoFar(trials, "minimize")).toEqual([2.0, 2.0, 1.5, 1.5, 1.5]);
    expect(bestSoFar(trials, "maximize")).toEqual([2.0, 2.0, 2.0, 2.0, 2.0]);
    expect(bestSoFar([{ number: 0, state: "running" }], "minimize")).toEqual([null]);
  });

  it("names parameters with their values and maps states to badges", () => {
    expect(fmtParams({ "training.lr": 0.0031234567, "strategy.kind": "fsdp" })).toBe(
      "training.lr=0.003123 strategy.kind=fsdp",
    );
    expect(trialBadge("complete")).toBe("succeeded");
    expect(trialBadge("pruned")).toBe("cancelled");
    expect(trialBadge("running")).toBe("running");
  });

  it("places values on log, linear and categorical axes from the declared ranges", () => {
    const [lr, hidden, opt] = paramAxes({
      "training.lr": { type: "float", low: 1e-4, high: 1e-2, log: true },
      "workload.params.hidden": { type: "int", low: 8, high: 32 },
      "training.optimizer": { type: "categorical", choices: ["adam", "sgd", "adamw"] },
    });
    expect(axisPos(lr!, 1e-3)).toBeCloseTo(0.5);
    expect(axisPos(hidden!, 14)).toBeCloseTo(0.25);
    expect(axisPos(opt!, "sgd")).toBe(0.5);
    expect(axisPos(opt!, "rmsprop")).toBeNull();
    expect(axisPos(lr!, 0)).toBeNull();
    expect(valueAxis([])).toBeNull();
    expect(valueAxis([2, 2])).toMatchObject({ lo: 2, hi: 3 });
  });

  it("leaves out a conditional parameter a trial was not asked (its line skips that axis)", () => {
    const [kind, hook] = paramAxes({
      "strategy.kind": { type: "categorical", choices: ["ddp", "local_sgd"] },
      "strategy.comm_hook": { type: "categorical", choices: ["allreduce", "fp16"] },
    });
    const params: Record<string, unknown> = { "strategy.kind": "local_sgd" };
    expect(axisPos(kind!, params["strategy.kind"])).toBe(1);
    expect(axisPos(hook!, params["strategy.comm_hook"])).toBeNull();
    expect(fmtParams(params)).toBe("strategy.kind=local_sgd");
  });

  it("turns the form's rows into a space and sorts a 422's messages to them", () => {
    const rows = [
      { path: "training.lr", type: "float" as const, low: "0.1", high: "0.1", log: true, choices: "" },
      { path: "training.optimizer", type: "categorical" as const, low: "", high: "", log: false, choices: "adam, 0.5, true" },
    ];
    expect(spaceOf(rows)).toEqual({
      "training.lr": { type: "float", low: 0.1, high: 0.1, log: true },
      "training.optimizer": { type: "categorical", choices: ["adam", 0.5, true] },
    });
    expect(parseChoices(" , a,,1 ")).toEqual(["a", 1]);
    const sorted = sortErrors(
      [
        { loc: ["body", "space", "training.lr", "float"], msg: "Value error, the range is empty" },
        { loc: ["body", "n_trials"], msg: "too big" },
      ],
      rows,
    );
    expect(sorted).toEqual({ byRow: { 0: ["the range is empty"] }, rest: ["n_trials: too big"] });
  });
});
