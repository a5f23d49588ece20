// Pure helpers of the sweeps pages (tested in sweeps.test.ts).

export interface TrialLike {
  number: number;
  state: string;
  value?: number | null;
}

/** The best complete value among trials 0..i, for each trial in number order (null before any). */
export function bestSoFar(trials: TrialLike[], direction: "minimize" | "maximize"): (number | null)[] {
  let best: number | null = null;
  return [...trials]
    .sort((a, b) => a.number - b.number)
    .map((t) => {
      const v = t.state === "complete" ? (t.value ?? null) : null;
      if (v !== null && (best === null || (direction === "minimize" ? v < best : v > best))) best = v;
      return best;
    });
}

/** A trial state drawn with the run badges' colours. */
export function trialBadge(state: string): string {
  if (state === "complete") return "succeeded";
  if (state === "pruned") return "cancelled";
  return state;
}

/** "training.lr=0.003 workload.params.hidden=128" */
export function fmtParams(params: Record<string, unknown>): string {
  return Object.entries(params)
    .map(([k, v]) => `${k}=${typeof v === "number" ? Number(v.toPrecision(4)) : String(v)}`)
    .join(" ");
}

/** One axis of the parallel coordinates: a numeric range (log-scaled for a log parameter) or the
 * choices of a categorical one, evenly spaced. */
export interface Axis {
  path: string;
  log: boolean;
  lo: number;
  hi: number;
  choices?: unknown[];
}

interface ParamLike {
  type: string;
  low?: number;
  high?: number;
  log?: boolean;
  choices?: unknown[];
}

/** The axes of a sweep's space, from its declared ranges (stable while trials come in). */
export function paramAxes(space: Record<string, ParamLike>): Axis[] {
  return Object.entries(space).map(([path, p]) =>
    p.type === "categorical"
      ? { path, log: false, lo: 0, hi: Math.max(1, (p.choices ?? []).length - 1), choices: p.choices ?? [] }
      : { path, log: Boolean(p.log), lo: p.low ?? 0, hi: p.high ?? 1 },
  );
}

/** The objective's axis over the values trials gave (null: none yet). */
export function valueAxis(values: number[]): Axis | null {
  const finite = values.filter((v) => Number.isFinite(v));
  if (!finite.length) return null;
  const lo = Math.min(...finite);
  const hi = Math.max(...finite);
  return { path: "objective", log: false, lo, hi: hi > lo ? hi : lo + 1 };
}

/** Where ``v`` sits on ``axis``, 0 (its low end) to 1 (its high end); null where it cannot. */
export function axisPos(axis: Axis, v: unknown): number | null {
  if (axis.choices) {
    const i = axis.choices.findIndex((c) => c === v);
    return i < 0 ? null : axis.choices.length === 1 ? 0.5 : i / (axis.choices.length - 1);
  }
  if (typeof v !== "number" || !Number.isFinite(v)) return null;
  if (axis.log) {
    if (v <= 0 || axis.lo <= 0) return null;
    return (Math.log(v) - Math.log(axis.lo)) / (Math.log(axis.hi) - Math.log(axis.lo));
  }
  return (v - axis.lo) / (axis.hi - axis.lo);
}

/** A line's colour by its objective: 0 the best value (blue) → 1 the worst (orange). */
export function rankColor(t: number): string {
  const c = Math.min(1, Math.max(0, t));
  const mix = (a: number, b: number) => Math.round(a + (b - a) * c);
  return `rgb(${mix(37, 234)}, ${mix(99, 88)}, ${mix(235, 12)})`;
}

/** A parameter row of the new-sweep form, as typed. */
export interface ParamRow {
  path: string;
  type: "float" | "int" | "categorical";
  low: string;
  high: string;
  log: boolean;
  choices: string; // comma-separated
}

function parseNumber(text: string): number | null {
  const t = text.trim();
  return t === "" || !Number.isFinite(Number(t)) ? null : Number(t);
}

/** "0.1, 0.3, adam, true" → [0.1, 0.3, "adam", true] */
export function parseChoices(text: string): (string | number | boolean)[] {
  return text
    .split(",")
    .map((c) => c.trim())
    .filter((c) => c !== "")
    .map((c) => (c === "true" ? true : c === "false" ? false : (parseNumber(c) ?? c)));
}

/** The search space the rows describe, as POST /api/v1/sweeps takes it: the server checks it
 * (an empty range, a path the spec lacks: a 422 naming the parameter). */
export function spaceOf(rows: ParamRow[]): Record<string, unknown> {
  const space: Record<string, unknown> = {};
  for (const r of rows) {
    if (r.type === "categorical") space[r.path.trim()] = { type: "categorical", choices: parseChoices(r.choices) };
    else space[r.path.trim()] = { type: r.type, low: parseNumber(r.low), high: parseNumber(r.high), log: r.log };
  }
  return space;
}

/** A 422's messages sorted to the form's parameter rows (loc ["body", "space", path, ...]) and the rest. */
export function sortErrors(
  errors: { loc: (string | number)[]; msg: string }[],
  rows: ParamRow[],
): { byRow: Record<number, string[]>; rest: string[] } {
  const byRow: Record<number, string[]> = {};
  const rest: string[] = [];
  for (const e of errors) {
    const msg = e.msg.replace(/^Value error, /, ""); // pydantic's prefix to a validator's message
    const row = e.loc[1] === "space" ? rows.findIndex((r) => r.path.trim() === e.loc[2]) : -1;
    if (row >= 0) (byRow[row] ??= []).push(msg);
    else rest.push(`${e.loc.filter((p) => p !== "body").join(".")}: ${msg}`);
  }
  return { byRow, rest };
}
