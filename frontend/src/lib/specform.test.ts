import { describe, expect, it } from "vitest";
import { crossChecks, defaults, fieldForError, RUN_SPEC, validate, type Obj } from "./specform";

describe("the form from the run spec schema", () => {
  const spec = defaults(RUN_SPEC) as Obj;
  it("starts from the schema's defaults", () => {
    expect((spec.workload as Obj).name).toBe("mlp");
    expect((spec.training as Obj).steps).toBe(100);
  });
  it("checks bounds and the batch split like the server", () => {
    const bad = { ...spec, name: "", training: { ...(spec.training as Obj), lr: 0, batch_size: 63 } };
    const errors = { ...validate(RUN_SPEC, bad), ...crossChecks({ ...bad, resources: { nodes: 1, procs_per_node: 2 } }) };
    expect(errors["name"]).toBe("required");
    expect(errors["training.lr"]).toBe("must be > 0");
    expect(errors["training.batch_size"]).toContain("divisible");
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
});
