import { describe, expect, it } from "vitest";
import { applies, defaultName, labelFor, submitted } from "./formlayout";
import type { Obj } from "./specform";

describe("the new-run form's layout", () => {
  it("labels fields in words with their units", () => {
    expect(labelFor(["training", "lr"])).toBe("Learning rate");
    expect(labelFor(["training", "cancel_grace_s"])).toBe("Cancel grace (s)");
    expect(labelFor(["training", "stall_timeout_s"])).toBe("Stall timeout (s)");
    expect(labelFor(["training", "log_every"])).toBe("Log every (steps)");
    expect(labelFor(["workload", "name"])).toBe("Workload");
    expect(labelFor(["workload", "params", "hidden"])).toBe("Hidden width");
  });
  it("hides what a script does not use and leaves it out of what is sent", () => {
    const script: Obj = {
      name: "",
      workload: { kind: "script", name: "script", bundle: "b", entry: "train.py", args: ["--x", "1"] },
      strategy: { kind: "ddp" },
      training: { steps: 10, batch_size: 64, lr: 0.01, checkpoint_every: 5, seed: 0 },
    };
    expect(applies("strategy", script)).toBe(false);
    expect(applies("training.steps", script)).toBe(true);
    expect(submitted(script)).toEqual({
      workload: script.workload,
      training: { steps: 10, seed: 0 },
    });
    expect(defaultName(script)).toBe("train.py");
    expect(defaultName({ workload: { name: "mlp" }, strategy: { kind: "fsdp" } })).toBe("mlp-fsdp");
  });
});
