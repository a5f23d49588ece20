// The new-run form's layout: what people set first on top (workload, steps, processes, strategy,
// batch, learning rate, name), everything else under "Advanced"; labels with units, help text, and
// the fields that do not apply to a script hidden. The fields themselves come from the schema
// (specform.ts): a field added to the spec appears under Advanced with a label made from its name.
import type { Json, JsonSchema, Obj } from "./specform";

/** Paths in the main section, in order (a union path is its kind selector and its own fields). */
export const MAIN = ["workload", "training.steps", "resources.procs_per_node", "resources.nodes", "strategy", "training.batch_size", "training.lr", "name"];

/** The form's starting values where they differ from the api's: the CLI's (cli/main.py `submit --procs`,
 * a test holds the two equal). */
export const FORM_DEFAULTS: Record<string, Json> = { "resources.procs_per_node": 2 };

// Fields a script does not use: its own loop decides them (the server refuses some outright).
const NOT_FOR_SCRIPTS = [
  "strategy", "training.batch_size", "training.lr", "training.checkpoint_every", "training.checkpoint_final",
  "training.profile_every", "training.checkpoint_on_cancel",
];

// Fields in the order people look for them (the schema's order is alphabetical): a workload's
// size first, then the rest; under Advanced, training's knobs before the cluster's.
const ORDER = [
  "input_dim", "hidden", "layers", "classes", "samples", "d_model", "n_layers", "n_heads", "seq_len", "corpus_bytes",
  "at_step", "rank", "times", "hang", "bundle", "entry", "args", "comm_hook", "stages", "microbatches", "schedule",
  "tp_degree", "sequence_parallel", "period", "warmup_steps", "seed", "log_every", "checkpoint_every", "checkpoint_final", "checkpoint_on_cancel", "profile_every",
  "max_attempts", "max_restarts", "stall_timeout_s", "max_duration_s", "cancel_grace_s", "device", "priority",
];

/** Sorts fields (paths) by ORDER of their names; others after them, as they came. */
export function inFormOrder<T>(fields: [string[], T][]): [string[], T][] {
  const rank = (p: string[]) => {
    const i = ORDER.indexOf(p[p.length - 1] ?? "");
    return i < 0 ? ORDER.length : i;
  };
  return fields.map((f, i) => [f, i] as const).sort((a, b) => rank(a[0][0]) - rank(b[0][0]) || a[1] - b[1]).map(([f]) => f);
}

interface Meta {
  label: string;
  help?: string;
}

// Keyed by the field's name within its section (a workload's params share names across workloads).
const META: Record<string, Meta> = {
  name: { label: "Name", help: "optional: the server names it workload-strategy (e.g. mlp-ddp), a script by its entry" },
  "workload.name": { label: "Workload" },
  "strategy.kind": {
    label: "Strategy",
    help: "how the ranks share the work: data parallel (ddp, local_sgd, zero, fsdp), model parallel (pipeline, tp: tensor parallel), or both (fsdp_tp); or a parameter server with bounded staleness (async)",
  },
  steps: { label: "Steps", help: "optimizer steps (a script: the steps you expect, for the progress bar)" },
  procs_per_node: { label: "Processes per node", help: "ranks on each node (torchrun's --nproc-per-node)" },
  nodes: { label: "Nodes", help: "placed together: all at once or not at all" },
  batch_size: { label: "Batch size (global)", help: "samples per step over all ranks, split evenly across them" },
  lr: { label: "Learning rate" },
  seed: { label: "Random seed" },
  device: { label: "Device" },
  priority: { label: "Priority" },
  comm_hook: { label: "Gradient comm hook", help: "DDP's all-reduce as is, compressed to fp16/bf16, or PowerSGD" },
  powersgd_rank: { label: "PowerSGD rank" },
  powersgd_warmup: { label: "PowerSGD warm-up (steps)" },
  input_dim: { label: "Input features" },
  hidden: { label: "Hidden width" },
  d_model: { label: "Model width (d_model)" },
  n_layers: { label: "Layers" },
  n_heads: { label: "Attention heads" },
  seq_len: { label: "Sequence length (tokens)" },
  corpus_bytes: { label: "Corpus size (bytes)" },
  bundle: { label: "Code bundle id" },
  entry: { label: "Entry script" },
  args: { label: "Script arguments" },
  at_step: { label: "Fail at step" },
  warmup_steps: { label: "Warm-up (steps)" },
  period: { label: "Averaging period (steps)" },
  checkpoint_on_cancel: { label: "Checkpoint on cancel" },
  checkpoint_final: { label: "Checkpoint the last step" },
  tp_degree: { label: "TP degree (ranks per tensor-parallel group)" },
  sequence_parallel: { label: "Sequence parallel" },
};

/** The field's label: from META, else its name made readable with its unit ("cancel_grace_s" → "Cancel grace (s)"). */
export function labelFor(path: string[]): string {
  const name = path[path.length - 1] ?? "";
  const meta = META[path.join(".")] ?? META[path.slice(-2).join(".")] ?? META[name];
  if (meta) return meta.label;
  let words = name.split("_");
  let unit = "";
  if (words.length > 1 && words[words.length - 1] === "s") {
    words = words.slice(0, -1);
    unit = " (s)";
  } else if (words[words.length - 1] === "every") unit = " (steps)";
  const text = words.join(" ");
  return text.charAt(0).toUpperCase() + text.slice(1) + unit;
}

export function helpFor(path: string[], schema: JsonSchema): string | undefined {
  const name = path[path.length - 1] ?? "";
  return (META[path.join(".")] ?? META[name])?.help ?? schema.description;
}

export function isScript(spec: Obj): boolean {
  return (spec.workload as Obj | undefined)?.name === "script";
}

/** Whether the field at ``path`` is shown for this spec. */
export function applies(path: string, spec: Obj): boolean {
  return !(isScript(spec) && NOT_FOR_SCRIPTS.some((p) => path === p || path.startsWith(p + ".")));
}

/** The spec as submitted: fields that do not apply left out (the server's defaults hold), an empty
 * name left out (the server names the run). */
export function submitted(spec: Obj): Obj {
  const out: Obj = JSON.parse(JSON.stringify(spec)) as Obj;
  if (!out.name) delete out.name;
  if (isScript(out)) {
    for (const path of NOT_FOR_SCRIPTS) {
      const parts = path.split(".");
      const parent = parts.length > 1 ? (out[parts[0] as string] as Obj | undefined) : out;
      if (parent) delete parent[parts[parts.length - 1] as string];
    }
  }
  return out;
}

/** The name the server would give (the name field's placeholder). */
export function defaultName(spec: Obj): string {
  const w = (spec.workload ?? {}) as Obj;
  if (w.name === "script") return String(w.entry || "the entry script");
  return `${String(w.name ?? "workload")}-${String(((spec.strategy ?? {}) as Obj).kind ?? "ddp")}`;
}
