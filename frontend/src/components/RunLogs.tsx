// The run page's log panel: the end of the log first (where a failure's traceback is), older pages
// on demand, live lines as they come, a rank filter, and noise (profiler trace points, framework
// warnings) folded behind a visible "N hidden" toggle.
import type { ComponentChildren } from "preact";
import { useEffect, useLayoutEffect, useRef, useState } from "preact/hooks";
import { api, ok } from "../api/client";
import { fmtTs } from "../lib/format";
import { isRankTraceback, LogBuffer, noiseKinds, TRACEBACK, tracebackLines, type Line } from "../lib/logs";
import { loadPrefs, savePrefs } from "../lib/prefs";
import { ErrorBox } from "./ui";

export const LOG_PAGE = 2000; // lines per read: the tail first, then each older page
const FAILURE_TRIES = 30; // a minute of looking, every FAILURE_RETRY_MS
const FAILURE_RETRY_MS = 2000;

/** The log's last page, from the api. */
export async function readTail(runId: number): Promise<Line[]> {
  return ok(await api.GET("/api/v1/runs/{run_id}/logs", { params: { path: { run_id: runId }, query: { tail: true, limit: LOG_PAGE } } }));
}

interface Failure {
  rank: number;
  lines: Line[];
}

/**
 * A failed run's root cause, shown above its log: the first traceback a rank printed in the newest
 * attempt (torchrun's own, on the launcher's lines, only points at it), read where it is. It need
 * not be near the end: torchrun relays a rank's stdout and stderr apart, so a script that printed
 * much before it raised has its last printed lines after its traceback, thousands of lines later.
 */
async function readFailure(runId: number): Promise<Failure | string> {
  const path = { run_id: runId };
  const found = ok(await api.GET("/api/v1/runs/{run_id}/logs", { params: { path, query: { contains: TRACEBACK, tail: true, limit: 100 } } }));
  const starts = found.filter(isRankTraceback);
  const newest = Math.max(...starts.map((l) => l.attempt));
  const start = starts.find((l) => l.attempt === newest);
  if (!start) return `${found.length} lines hold "${TRACEBACK}", none a rank's`;
  const lines = ok(await api.GET("/api/v1/runs/{run_id}/logs", { params: { path, query: { rank: start.rank, after: start.id - 1, limit: 1000 } } }));
  return { rank: start.rank, lines: tracebackLines(lines) };
}

/** A read's outcome: the failure, or why none was found (yet). */
type Search = Promise<Failure | string>;

let early: { runId: number; found: Search } | null = null;

/** Starts reading a failed run's traceback at once, before the page's other reads queue up ahead
 * of it (a browser sends 6 requests to a host at a time, and the charts ask for ~25 series): the
 * card takes this read when it mounts. */
export function readFailureEarly(runId: number): void {
  early = { runId, found: readFailure(runId).catch((e: unknown) => String(e)) };
}

function takeEarly(runId: number): Search | null {
  const found = early?.runId === runId ? early.found : null;
  early = null;
  return found;
}

/** ``version``: the buffer's, as the page last saw it (a change re-renders the card). */
export function LogsCard({ runId, buffer, active, failed }: { runId: number; buffer: LogBuffer; version: number; active: boolean; failed: boolean }) {
  const [logRank, setLogRank] = useState<string>("all");
  const [showNoise, setShowNoise] = useState(loadPrefs().showNoise);
  const [loading, setLoading] = useState(false);
  const [error, setError] = useState<unknown>(undefined);
  const [full, setFull] = useState(false);
  const [, redraw] = useState(0);
  const [failure, setFailure] = useState<Failure | null>(null);
  // where the search for the traceback stands ("looking (try 3): <why the last try found none>",
  // "found", "none"): on the card as data-failure-search, for whoever wonders why there is no card
  const [search, setSearch] = useState("");
  useEffect(() => {
    setFailure(null);
    setSearch("");
    if (!failed) return;
    // A run is marked failed by its worker while its last lines may still be on their way through
    // ingest, and a read can fail on a busy api: look again for a while before giving up.
    let stopped = false;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const look = (tries: number) => {
      (takeEarly(runId) ?? readFailure(runId).catch((e: unknown) => String(e)))
        .then((found) => {
          if (stopped) return;
          if (typeof found !== "string") {
            setFailure(found);
            setSearch(`found (try ${FAILURE_TRIES - tries + 1})`);
          } else if (tries > 1) {
            setSearch(`looking (try ${FAILURE_TRIES - tries + 1}): ${found}`);
            timer = setTimeout(() => look(tries - 1), FAILURE_RETRY_MS);
          } else setSearch(`none: ${found}`);
        });
    };
    look(FAILURE_TRIES);
    return () => {
      stopped = true;
      clearTimeout(timer);
    };
  }, [runId, failed]);
  const lines = buffer.lines;
  const ofRank = logRank === "all" ? lines : lines.filter((l) => String(l.rank) === logRank);
  const noise = noiseKinds(ofRank);
  const hidden = noise.filter((k) => k !== null).length;
  const kinds = [...new Set(noise.filter((k): k is string => k !== null))];
  const shown = showNoise ? ofRank.map((l, i) => ({ l, noise: noise[i] !== null })) : ofRank.filter((_, i) => noise[i] === null).map((l) => ({ l, noise: false }));
  const logRanks = [...new Set(lines.map((l) => l.rank))].sort((a, b) => a - b);

  const older = async () => {
    setLoading(true);
    setError(undefined);
    try {
      const before = buffer.oldestId();
      if (before === null) {
        buffer.setTail(await readTail(runId), LOG_PAGE); // only live lines held: read the end first
      } else {
        const page = ok(await api.GET("/api/v1/runs/{run_id}/logs", { params: { path: { run_id: runId }, query: { before, limit: LOG_PAGE } } }));
        setFull(!buffer.prepend(page, LOG_PAGE));
      }
      redraw((n) => n + 1);
    } catch (e) {
      setError(e);
    } finally {
      setLoading(false);
    }
  };

  return (
    <div class="card" data-testid="logs-card" data-failure-search={search}>
      <div class="card-head">
        <h2>Logs</h2>
        <div class="actions">
          {hidden > 0 && (
            <button
              class="btn btn-small"
              onClick={() => {
                setShowNoise(!showNoise);
                savePrefs({ showNoise: !showNoise });
              }}
              data-testid="log-noise-toggle"
              title="lines that say nothing about the run: torch.profiler's trace points and framework warnings"
            >
              {showNoise ? `Hide ${hidden} noise lines` : `${hidden} hidden (${kinds.join(", ")}): show`}
            </button>
          )}
          <select value={logRank} onChange={(e) => setLogRank((e.target as HTMLSelectElement).value)} data-testid="log-rank">
            <option value="all">All ranks</option>
            {logRanks.map((r) => (
              <option value={String(r)}>{r === -1 ? "launcher" : `rank ${r}`}</option>
            ))}
          </select>
        </div>
      </div>
      {error !== undefined && <ErrorBox error={error} />}
      {failure && (
        <div class="log-failure" data-testid="log-failure">
          <div class="muted">
            Where it failed: rank {failure.rank}'s traceback (it may sit far from the log's end: a rank's output and its
            errors are relayed apart)
          </div>
          <pre>{failure.lines.map((l) => l.text).join("\n")}</pre>
        </div>
      )}
      {lines.length === 0 ? (
        <div class="state state-empty">No log lines{active ? " yet" : ""}.</div>
      ) : (
        <LogView lines={shown} version={buffer.version} head={
          buffer.startReached ? (
            <div class="muted log-start" data-testid="log-start">— start of the log —</div>
          ) : full ? (
            <div class="muted log-start">{buffer.max.toLocaleString("en-US")} lines held: read older ones with GET /api/v1/runs/{runId}/logs?before={buffer.oldestId()}</div>
          ) : (
            <button class="btn btn-small log-older" onClick={older} disabled={loading} data-testid="log-older">
              {loading ? "Loading…" : `Older lines (${LOG_PAGE.toLocaleString("en-US")} more)`}
            </button>
          )
        } />
      )}
    </div>
  );
}

function LogView({ lines, version, head }: { lines: { l: Line; noise: boolean }[]; version: number; head: ComponentChildren }) {
  const box = useRef<HTMLPreElement>(null);
  const atBottom = useRef(true);
  const height = useRef(0);
  const firstId = useRef<number | null>(null);
  // Follow the end while the viewer is at it; keep the view still when older lines arrive above.
  useLayoutEffect(() => {
    const el = box.current;
    if (!el) return;
    const first = lines[0]?.l.id ?? null;
    if (atBottom.current) el.scrollTop = el.scrollHeight;
    else if (first !== firstId.current) el.scrollTop += el.scrollHeight - height.current;
    firstId.current = first;
    height.current = el.scrollHeight;
  }, [version, lines.length]);
  useEffect(() => {
    const el = box.current;
    if (!el) return;
    const onScroll = () => {
      atBottom.current = el.scrollHeight - el.scrollTop - el.clientHeight < 40;
    };
    el.addEventListener("scroll", onScroll);
    return () => el.removeEventListener("scroll", onScroll);
  }, []);
  return (
    <pre class="logs" ref={box} data-testid="logs">
      {head}
      {lines.map(({ l, noise }) => (
        <div class={noise ? "noise" : undefined}>
          <span class="muted">{fmtTs(l.ts)}</span> <span class="rank">[{l.rank === -1 ? "agent" : l.rank}]</span> {l.text}
        </div>
      ))}
    </pre>
  );
}
