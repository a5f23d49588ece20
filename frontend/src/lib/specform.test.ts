import { describe, expect, it } from "vitest";
import { crossChecks, defaults, fieldForError, RUN_SPEC, validate, variants, type Obj } from "./specform";

describe("the form from the run spec schema", () => {
  const spec = defaults(RUN_SPEC) as Obj;
  it("starts from the schema's defaults", () => {
    expect((spec.workload as Obj).name).toBe("mlp");
    expect((spec.training as Obj).steps).toBe(100);
  });
  it("checks bounds and the batch split like the server", () => {
    const bad = { ...spec, name: "x".repeat(201), training: { ...(spec.training as Obj), lr: 0, batch_size: 63 } };
    const errors = { ...validate(RUN_SPEC, bad), ...crossChecks({ ...bad, resources: { nodes: 1, procs_per_node: 2 } }) };
    expect(errors["name"]).toBe("at most 200 characters");
    expect(errors["training.lr"]).toBe("must be > 0");
    expect(errors["training.batch_size"]).toContain("divisible");
  });
  it("takes an optional field left empty as the server's default", () => {
    const training = { ...(spec.training as Obj), cancel_grace_s: null };
    expect(validate(RUN_SPEC, { ...spec, name: null, training })).toEqual({});
    expect(validate(RUN_SPEC, { ...spec, training: { ...training, cancel_grace_s: -1 } })["training.cancel_grace_s"]).toBe("must be ≥ 0");
    expect(validate(RUN_SPEC, { ...spec, training: { ...training, checkpoint_on_cancel: "yes" } })["training.checkpoint_on_cancel"]).toBe(
      "must be true or false",
    );
  });
  it("passes a run's spec as the server returns it (a clone), its unused sections null", () => {
    // GET /api/v1/runs/{id}'s spec of a plain run: `data` (a dataset section) is null
    const served = {"name": "test-run", "workload": {"kind": "builtin", "name": "mlp", "params": {"input_dim": 32, "hidden": 128, "layers": 3, "classes": 10, "samples": 8192}}, "strategy": {"kind": "ddp", "comm_hook": "allreduce", "powersgd_rank": 2, "powersgd_warmup": 10}, "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu", "priority": 0, "pool": null, "partition": null, "memory_limit_bytes": null}, "training": {"steps": 50, "batch_size": 64, "lr": 0.01, "seed": 0, "log_every": 1, "profile_every": 0, "checkpoint_every": 0, "checkpoint_final": true, "max_attempts": 3, "max_restarts": 0, "stall_timeout_s": 0.0, "max_duration_s": 0.0, "checkpoint_on_cancel": false, "cancel_grace_s": null}, "data": null} as unknown as Obj;
    expect(served.data).toBeNull();
    expect(validate(RUN_SPEC, { ...served, name: "test-run (clone)" })).toEqual({});
    expect(validate(RUN_SPEC, { ...served, data: {} })["data.dataset"]).toBe("required"); // a section given is checked
  });
  it("maps the server's 422 locations onto form fields", () => {
    const known = ["name", "workload.params.hidden", "training.batch_size", "resources.device"];
    expect(fieldForError(["body", "workload", "mlp", "params", "hidden"], "too big", known, spec)).toBe("workload.params.hidden");
    expect(fieldForError(["body", "resources", "device"], "no node", known, spec)).toBe("resources.device");
    expect(fieldForError(["body"], "Value error, training.batch_size (63) must be divisible", known, spec)).toBe(
      "training.batch_size",
    );
    expect(fieldForError(["body"], "something else", known, spec)).toBeNull();
  });
  it("offers every strategy, tensor parallelism and the 2-D mesh too, with their own fields and defaults", () => {
    const strategies = variants(RUN_SPEC.properties?.strategy ?? {});
    expect([...(strategies?.options.keys() ?? [])]).toEqual(["ddp", "fsdp", "pipeline", "local_sgd", "zero", "tp", "fsdp_tp", "async"]);
    const twoD = strategies?.options.get("fsdp_tp") ?? {};
    expect(defaults(twoD)).toEqual({ kind: "fsdp_tp", tp_degree: 2, sequence_parallel: true, reshard_after_forward: true });
    expect(defaults(strategies?.options.get("tp") ?? {})).toEqual({ kind: "tp", sequence_parallel: true });
    // the server's refusal of a shape that does not split lands on the field it names
    const known = ["workload.params.hidden", "strategy.tp_degree", "strategy.kind"];
    const tp = { ...spec, strategy: { kind: "fsdp_tp", tp_degree: 3 } };
    expect(fieldForError(["body"], "Value error, strategy.tp_degree (3) must divide nodes × procs_per_node (4)", known, tp)).toBe(
      "strategy.tp_degree",
    );
    expect(
      fieldForError(["body"], "Value error, workload.params.hidden (30) must be divisible by the TP degree, nodes × procs_per_node (4)", known, tp),
    ).toBe("workload.params.hidden");
  });
});
