// The run page's chart model: which charts a run's metric keys give, in which section, and how
// each is drawn. The data for them is shaped in chartdata.ts.

export type SectionId = "training" | "speed" | "communication" | "system" | "other";
export const SECTIONS: { id: SectionId; title: string; help: string }[] = [
  { id: "training", title: "Training", help: "loss and learning rate" },
  { id: "speed", title: "Speed", help: "throughput, and where each step's time goes" },
  {
    id: "communication",
    title: "Communication",
    help: "collectives: the share of the step spent waiting for them, their time, bandwidth and bytes",
  },
  { id: "system", title: "System", help: "memory (and the GPU's figures where a run reports them)" },
  { id: "other", title: "Other", help: "everything else the run logs" },
];

export type Format = "number" | "seconds" | "bytes" | "percent";

export interface ChartDef {
  id: string; // the test id's suffix: chart-<id>
  section: SectionId;
  title: string;
  help?: string;
  keys: string[]; // metric keys it reads
  labels: string[]; // one per series it draws (before smoothing adds the raw ones)
  kind: "band" | "lines" | "stacked"; // band: one key's across-rank mean with its min and max
  perRankKey?: string; // the key drawn one line per rank when per-rank lines are on
  throughput?: number; // y = this / the step's slowest step_time_s (the global batch, or its tokens)
  scale?: number; // multiply y (a script's throughput: mean over ranks × ranks)
  format?: Format;
}

/** What the charts need to know of the run's spec. batch null: a script (its batch is its own). */
export interface RunShape {
  world: number;
  batch: number | null;
  seqLen: number | null; // tokens per sample (charlm)
}

// Step time split into parts that add up to it (README: compute = step − data − exposed comm), bottom first.
export const STEP_PARTS = ["data_time_s", "compute_time_s", "exposed_comm_s"];
// data_time_s split in two that add up to it (the loop marks the batch in host memory), bottom first.
export const DATA_PARTS = ["data_wait_s", "data_copy_s"];
const FOLDED = new Set(["loss", "lr", "step_time_s", "samples_per_s", "tokens_per_s", ...STEP_PARTS, ...DATA_PARTS]);
const COMM_KEYS = ["comm_fraction", "comm_time_s", "first_comm_at_s", "busbw_GBps", "algbw_GBps", "busbw_efficiency", "comm_bytes"];
const TRACE_PARTS = ["prof_comm_time_s", "prof_exposed_comm_s"]; // the sampled steps' figures: one chart
const SYSTEM = /^(max_rss_bytes$|param_bytes$|optimizer_state_bytes$|cuda_|gpu_|nvml_)/;
const KIND_BYTES = "comm_bytes_"; // comm_bytes_<kind>: a step's bytes of one collective kind

// A run may log up to TORCHYARD_MAX_METRIC_KEYS (1,000) keys; a page of 1,000 charts (and as many
// requests) would not draw. The first MAX_KEY_CHARTS of the other keys get a chart; the page says how
// many did not, and each is one /metrics?key= away.
export const MAX_KEY_CHARTS = 24;
export const MAX_LIVE_KEYS = 1000; // keys the live stream may add (it carries what ranks send, before ingest's bound)
export const MAX_RANK_LINES = 16; // per-rank lines: the first ranks (a 256-rank run is a table, not a chart)

/** The keys that get a chart of their own in "system" or "other", in order. */
export function otherKeys(keys: string[]): string[] {
  return keys.filter((k) => !(FOLDED.has(k) || COMM_KEYS.includes(k) || k.startsWith("prof_") || k.startsWith(KIND_BYTES)));
}

function formatOf(key: string): Format {
  if (key.endsWith("_bytes")) return "bytes";
  if (key.endsWith("_fraction")) return "percent";
  if (key.endsWith("_s")) return "seconds";
  return "number";
}

export function chartDefs(keys: string[], shape: RunShape): ChartDef[] {
  const have = new Set(keys);
  const defs: ChartDef[] = [];
  const single = (key: string, section: SectionId, title: string, help?: string): void => {
    if (have.has(key)) defs.push({ id: `key:${key}`, section, title, help, keys: [key], labels: [key], kind: "lines", perRankKey: key, format: formatOf(key) });
  };

  if (have.has("loss"))
    defs.push({ id: "loss", section: "training", title: "Loss", help: "mean over ranks; the band is the lowest and highest rank", keys: ["loss"], labels: ["mean", "min", "max"], kind: "band", perRankKey: "loss" });
  single("lr", "training", "Learning rate");

  const thrHelp = "the global batch over each step's slowest rank's step time (a step ends when its slowest rank does)";
  if (shape.batch !== null && have.has("step_time_s")) {
    defs.push({ id: "throughput", section: "speed", title: "Throughput (samples/s)", help: thrHelp, keys: ["step_time_s"], labels: ["samples/s"], kind: "lines", perRankKey: "samples_per_s", throughput: shape.batch });
    if (shape.seqLen !== null && have.has("tokens_per_s"))
      defs.push({ id: "tokens", section: "speed", title: "Throughput (tokens/s)", help: thrHelp, keys: ["step_time_s"], labels: ["tokens/s"], kind: "lines", perRankKey: "tokens_per_s", throughput: shape.batch * shape.seqLen });
  } else {
    const help = "what the ranks report, added up";
    for (const [key, unit] of [["samples_per_s", "samples"], ["tokens_per_s", "tokens"]] as const)
      if (have.has(key)) defs.push({ id: unit === "samples" ? "throughput" : "tokens", section: "speed", title: `Throughput (${unit}/s)`, help, keys: [key], labels: [`${unit}/s`], kind: "lines", perRankKey: key, scale: shape.world });
  }
  const parts = STEP_PARTS.filter((k) => have.has(k));
  if (parts.length === STEP_PARTS.length) {
    defs.push({ id: "steptime", section: "speed", title: "Step time: data, compute, exposed comm (stacked, s)", help: "the parts add up to the step time (mean over ranks); exposed comm is the communication the step waited for", keys: parts, labels: ["exposed comm", "compute", "data"], kind: "stacked", perRankKey: "step_time_s", format: "seconds" });
  } else if (have.has("step_time_s")) {
    const missing = STEP_PARTS.filter((k) => !have.has(k));
    const keys = ["step_time_s", ...parts];
    defs.push({ id: "steptime", section: "speed", title: `Step time (s) — not reported yet: ${missing.join(", ")}`, keys, labels: keys, kind: "lines", perRankKey: "step_time_s", format: "seconds" });
  }

  if (DATA_PARTS.every((k) => have.has(k)))
    defs.push({ id: "datatime", section: "speed", title: "Data time: waiting for the batch, copying it to the device (stacked, s)", help: "the parts add up to data_time_s (mean over ranks): a wait that grows is a loader that does not keep up", keys: DATA_PARTS, labels: ["copy to device", "wait for batch"], kind: "stacked", perRankKey: "data_time_s", format: "seconds" });

  single("comm_fraction", "communication", "Comm fraction", "exposed comm / step time: the share of each step spent waiting for communication");
  const commTimes = ["comm_time_s", "exposed_comm_s"].filter((k) => have.has(k));
  if (have.has("comm_time_s"))
    defs.push({ id: "comm", section: "communication", title: "Exposed vs total comm (s)", help: "total: collectives in flight; exposed: the part the step waited for (not hidden behind compute)", keys: commTimes, labels: commTimes.map((k) => (k === "comm_time_s" ? "total" : "exposed")), kind: "lines", perRankKey: "exposed_comm_s", format: "seconds" });
  single("first_comm_at_s", "communication", "Arrival at the first collective (s)", "from the step's start to its first collective: a rank that arrives later than the others keeps them waiting (per-rank lines show which)");
  const bw = ["busbw_GBps", "algbw_GBps"].filter((k) => have.has(k));
  if (bw.length)
    defs.push({ id: "busbw", section: "communication", title: "Bandwidth (GB/s)", help: "busbw: nccl-tests' bus bandwidth; algbw: bytes / comm time", keys: bw, labels: bw.map((k) => k.replace("_GBps", "")), kind: "lines", perRankKey: bw[0] });
  single("busbw_efficiency", "communication", "busbw efficiency", "busbw / the calibrated all-reduce busbw at the step's message size");
  single("comm_bytes", "communication", "Comm bytes per step");
  const kinds = keys.filter((k) => k.startsWith(KIND_BYTES)).sort();
  if (kinds.length)
    defs.push({ id: "commkinds", section: "communication", title: "Comm bytes per step, by collective", help: "all-reduce, all-gather, reduce-scatter, ...: what each kind of collective moved (mean over ranks)", keys: kinds, labels: kinds.map((k) => k.slice(KIND_BYTES.length).replaceAll("_", "-")), kind: "lines", perRankKey: "comm_bytes", format: "bytes" });
  const traced = TRACE_PARTS.filter((k) => have.has(k));
  if (traced.length)
    defs.push({ id: "traced", section: "communication", title: "Sampled steps, from the torch.profiler trace: comm vs exposed comm (s)", keys: traced, labels: traced, kind: "lines", format: "seconds" });

  for (const k of otherKeys(keys).slice(0, MAX_KEY_CHARTS)) single(k, SYSTEM.test(k) ? "system" : "other", k);
  return defs;
}

/** Where each later attempt of a run took over, as chart markers: at its first step, or (wall-time
 * axis) when it started. The first attempt needs none. */
export function attemptMarks(
  attempts: { number: number; first_step: number | null; started_at: string | null }[],
  time: boolean,
): { x: number; label: string }[] {
  const marks = [];
  for (const a of attempts) {
    if (a.number < 2) continue;
    const x = time ? (a.started_at ? Date.parse(a.started_at) / 1000 : null) : a.first_step;
    if (x !== null && Number.isFinite(x)) marks.push({ x, label: `attempt ${a.number}` });
  }
  return marks;
}
