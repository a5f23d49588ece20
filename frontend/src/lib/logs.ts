// The log panel's noise: lines that say nothing about the run, folded behind a "N hidden" toggle.

const NOISE: [RegExp, string][] = [
  [/^USDT:/, "profiler"], // torch.profiler's own start/stop trace points
  [/^\S+\.py:\d+: \w*Warning: /, "warning"], // a Python warning (torch's own, for the built-in workloads)
  [/^\s+warnings\.warn\(/, "warning"], // ... and the source line Python prints under it
  [/^\[W\d{4} \d\d:\d\d:\d\d/, "warning"], // a C++ warning from torch (c10's "[W1204 12:00:00.000 ...")
];

/** Why a line is noise ("profiler", "warning"), or null for a line worth showing. */
export function noiseKind(text: string): string | null {
  for (const [re, kind] of NOISE) if (re.test(text)) return kind;
  return null;
}

const PYTHON_WARNING = NOISE[1]![0];

/** Each line's noise kind, as noiseKind, and a Python warning's second line with it: Python prints
 * the source line of the call that warned under the warning, indented, and it reads as anything
 * (`warnings.warn(`, or a line of torch's own code): left shown, it stood alone, its warning hidden.
 * Lines are followed per rank (ranks' lines interleave). */
export function noiseKinds(lines: readonly Pick<Line, "rank" | "text">[]): (string | null)[] {
  const afterWarning = new Set<number>(); // ranks whose last line was a Python warning
  return lines.map(({ rank, text }) => {
    const continues = afterWarning.has(rank) && /^\s+\S/.test(text);
    afterWarning.delete(rank);
    if (PYTHON_WARNING.test(text)) afterWarning.add(rank);
    return continues ? "warning" : noiseKind(text);
  });
}

export interface Line {
  id: number; // the database's id; 0 for a line the live stream brought (not stored yet)
  attempt: number;
  rank: number;
  ts: number;
  text: string;
}

/**
 * The log lines the panel holds: the end of the log (read with tail=true), older pages put in front
 * as the viewer asks for them (before=<the oldest id>), live lines appended. At most ``max`` lines:
 * live lines push the oldest out; an older page that would pass the bound is refused.
 */
export class LogBuffer {
  lines: Line[] = [];
  version = 0; // grows with every change: the panel redraws only then
  startReached = false; // the first line of the log is loaded
  private readUntil = -Infinity; // the time of the newest line read from the api: live ones up to it are held

  constructor(public max = 10_000) {}

  /** The log's end as the api has it; live lines newer than its last stay after it. */
  setTail(fetched: Line[], page: number): void {
    this.readUntil = fetched.length ? (fetched[fetched.length - 1] as Line).ts : -Infinity;
    this.lines = [...fetched, ...this.lines.filter((l) => l.id === 0 && l.ts > this.readUntil)];
    this.startReached = fetched.length < page;
    this.trim();
  }

  /** An older page (ids below the oldest held): false when it would pass the bound. */
  prepend(older: Line[], page: number): boolean {
    if (this.lines.length + older.length > this.max) return false;
    this.lines = [...older, ...this.lines];
    this.startReached = older.length < page;
    this.version++;
    return true;
  }

  /** Lines from the live stream (which never repeats one); those the api's read already held are skipped. */
  append(lines: Line[]): void {
    for (const l of lines) if (l.ts > this.readUntil) this.lines.push(l);
    this.trim();
  }

  /** The cursor for the next older page: the oldest held line's id, or null when none has one. */
  oldestId(): number | null {
    const first = this.lines[0];
    return first && first.id > 0 ? first.id : null;
  }

  private trim(): void {
    if (this.lines.length > this.max) {
      this.lines.splice(0, this.lines.length - this.max);
      this.startReached = false;
    }
    this.version++;
  }
}

export const TRACEBACK = "Traceback (most recent call last)";

/** Whether a rank (not the launcher, whose ChildFailedError only points at the rank) printed this traceback start. */
export function isRankTraceback(l: Line): boolean {
  return l.rank >= 0 && l.text.trimStart().startsWith(TRACEBACK);
}

/** An exception line ("RuntimeError: boom", "torch.distributed.DistBackendError: ...", "KeyboardInterrupt"). */
const EXCEPTION_LINE = /^[A-Za-z_][\w.]*(:|$)/;
const CHAIN = /^(During handling|The above exception)/;

/** One rank's lines from a traceback's first line up to and including its exception line (chained
 * exceptions too). Torchrun relays a rank's stdout and stderr apart, so the rank's printed lines
 * can sit between a traceback's own: a line at column 0 that is neither an exception nor part of a
 * chain is such a line, and is left out. */
export function tracebackLines(lines: Line[]): Line[] {
  const out: Line[] = [];
  for (const [i, l] of lines.entries()) {
    const t = l.text;
    if (i === 0 || t === "" || /^\s/.test(t) || t.startsWith(TRACEBACK) || CHAIN.test(t)) {
      out.push(l);
      continue;
    }
    // the rank's own output, relayed in between (noise such as "USDT:..." looks like an exception line)
    if (!EXCEPTION_LINE.test(t) || noiseKind(t)) continue;
    out.push(l);
    // the end, unless a chained traceback follows it
    if (lines[i + 1]?.text === "" && CHAIN.test(lines[i + 2]?.text ?? "")) continue;
    break;
  }
  return out;
}
