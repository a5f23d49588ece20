import { useCallback, useEffect, useMemo, useRef, useState } from "preact/hooks";
import {
  api,
  fetchSeries,
  ok,
  type LogLine,
  type LogsEvent,
  type MetricsEvent,
  type Run,
  type RunEvent,
} from "../api/client";
import { Chart, PALETTE, type ChartHandle, type SeriesDef } from "../components/Chart";
import { Checkpoints, SampledStep } from "../components/RunCards";
import { ErrorBox, Loading, Progress, StatusBadge } from "../components/ui";
import { LiveSeries, lastValue } from "../lib/data";
import { expose } from "../lib/debug";
import { fmtClock, fmtDuration, fmtSI, fmtTs } from "../lib/format";
import { go } from "../lib/route";
import { attemptMarks, chartData, chartDefs, interpolate, type ChartDef } from "../lib/runview";
import { RunStream, sinceAgo } from "../lib/stream";
import { duration, summary } from "./Runs";

const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const LOG_KEEP = 1000;
const RANK_KEYS = ["step_time_s", "comm_time_s", "exposed_comm_s", "samples_per_s"];

interface RankRow {
  rank: number;
  step: number;
  values: Record<string, number | null>;
}

// benchmarks/dashboard.py sets window.__tyPerf = [] to collect each redraw's milliseconds.
const perf = (window as unknown as { __tyPerf?: number[] }).__tyPerf;

function chartPx(): number {
  return Math.max(300, Math.floor((Math.min(window.innerWidth, 1800) - 96) / 2));
}

function seriesDefs(def: ChartDef): SeriesDef[] {
  if (def.band) {
    return [
      { label: def.labels[0] as string, color: PALETTE[0], width: 2 },
      { label: def.labels[1] as string, color: "#93c5fd", width: 1 },
      { label: def.labels[2] as string, color: "#93c5fd", width: 1 },
    ];
  }
  return def.labels.map((l, i) => ({ label: l, color: PALETTE[i % PALETTE.length] }));
}

function specSummary(run: Run): string {
  const spec = run.spec as {
    workload?: { name?: string; params?: Record<string, unknown> };
    resources?: { device?: string };
    training?: { steps?: number; batch_size?: number; lr?: number };
  };
  const s = summary(run);
  const params = Object.entries(spec.workload?.params ?? {})
    .map(([k, v]) => `${k}=${String(v)}`)
    .join(" ");
  return [
    `${spec.workload?.name ?? "?"}${params ? ` (${params})` : ""}`,
    `${s.strategy}`,
    `${s.shape} on ${spec.resources?.device ?? "cpu"}`,
    `${(spec.training?.steps ?? 0).toLocaleString("en-US")} steps`,
    `batch ${spec.training?.batch_size ?? "?"}`,
    `lr ${spec.training?.lr ?? "?"}`,
  ].join(" · ");
}

export function RunDetail({ id }: { id: number }) {
  const [run, setRun] = useState<Run | null>(null);
  const [error, setError] = useState<unknown>(undefined);
  const [events, setEvents] = useState<RunEvent[]>([]);
  const [keys, setKeys] = useState<string[] | null>(null);
  const [logs, setLogs] = useState<LogLine[]>([]);
  const [logRank, setLogRank] = useState<string>("all");
  const [ranks, setRanks] = useState<RankRow[]>([]);
  const [time, setTime] = useState(false);
  const [zoom, setZoom] = useState<[number, number] | null>(null);
  const [cancelling, setCancelling] = useState(false);
  const [actionError, setActionError] = useState<string | null>(null);
  const [points, setPoints] = useState(0);

  const series = useRef(new Map<string, LiveSeries>());
  const charts = useRef(new Map<string, ChartHandle>());
  const rankRef = useRef(new Map<number, RankRow>());
  const logBuf = useRef<LogLine[]>([]);
  const dirty = useRef(false);
  const zoomRef = useRef<[number, number] | null>(null);
  const zoomSeries = useRef<Map<string, LiveSeries> | null>(null); // the server's finer window
  const keysRef = useRef<string[]>([]);
  const timeRef = useRef(false);
  zoomRef.current = zoom;
  timeRef.current = time;

  const world = run ? summary(run).world : 1;
  const defs = useMemo(() => chartDefs(keys ?? [], world), [keys, world]);
  const defsRef = useRef(defs);
  defsRef.current = defs;

  const redraw = useCallback(() => {
    // A zoomed window shows the server's finer data, not the live tail.
    const source = zoomRef.current ? zoomSeries.current : series.current;
    if (!source) return;
    const t0 = performance.now();
    for (const def of defsRef.current) {
      const chart = charts.current.get(def.id);
      if (!chart) continue;
      const data = chartData(def, source, timeRef.current);
      chart.setData(data);
      if (def.id === "loss" && data[0].length && !performance.getEntriesByName("ty:loss-drawn").length) {
        performance.mark("ty:loss-drawn"); // read by benchmarks/dashboard.py
      }
    }
    perf?.push(performance.now() - t0);
  }, []);

  const loadRun = useCallback(async () => {
    const r = ok(await api.GET("/api/v1/runs/{run_id}", { params: { path: { run_id: id } } }));
    setRun(r);
    setEvents(ok(await api.GET("/api/v1/runs/{run_id}/events", { params: { path: { run_id: id } } })));
    return r;
  }, [id]);

  const loadHistory = useCallback(
    async (wanted: string[], lastStep: number) => {
      const px = chartPx();
      await Promise.all(
        wanted.map(async (key) => {
          const [full, latest] = await Promise.all([
            fetchSeries(id, key, px),
            RANK_KEYS.includes(key) && lastStep > 0 ? fetchSeries(id, key, 10, lastStep) : Promise.resolve(null),
          ]);
          const agg = full.aggregate;
          const r0 = Object.values(full.ranks)[0];
          const ts = interpolate(agg.step, r0?.step ?? [], r0?.ts ?? []);
          const s = series.current.get(key) ?? new LiveSeries();
          s.setHistory(agg.step, ts, agg.mean, agg.min, agg.max);
          series.current.set(key, s);
          for (const [rank, rs] of Object.entries(latest?.ranks ?? {})) {
            const row = rankRef.current.get(Number(rank)) ?? { rank: Number(rank), step: 0, values: {} };
            row.values[key] = lastValue(rs.value);
            row.step = Math.max(row.step, rs.step[rs.step.length - 1] ?? 0);
            rankRef.current.set(Number(rank), row);
          }
        }),
      );
      setRanks([...rankRef.current.values()].sort((a, b) => a.rank - b.rank));
      dirty.current = true;
    },
    [id],
  );

  // Load the run, its history and (while it is live) its stream.
  useEffect(() => {
    let stream: RunStream | null = null;
    let alive = true;
    series.current = new Map();
    rankRef.current = new Map();
    logBuf.current = [];
    setRun(null);
    setKeys(null);
    setError(undefined);
    setZoom(null);
    zoomRef.current = null;
    zoomSeries.current = null;
    expose("series", (key: string) => {
      const s = series.current.get(key);
      return s ? { x: s.x.slice(), n: s.contributions(), historyUntil: s.historyUntil } : null;
    });
    expose("stream", () => stream?.debug() ?? null);

    const onMetrics = (e: MetricsEvent) => {
      let n = 0;
      let fresh: string[] | null = null;
      const row = rankRef.current.get(e.rank) ?? { rank: e.rank, step: 0, values: {} };
      for (const [step, ts, scalars] of e.points) {
        for (const [key, value] of Object.entries(scalars)) {
          let s = series.current.get(key);
          if (!s) {
            s = new LiveSeries();
            series.current.set(key, s);
            if (!keysRef.current.includes(key)) (fresh ??= []).push(key);
          }
          if (s.add(step, ts, value)) n++;
          if (step >= row.step && RANK_KEYS.includes(key)) row.values[key] = value;
        }
        row.step = Math.max(row.step, step);
      }
      rankRef.current.set(e.rank, row);
      if (fresh) {
        keysRef.current = [...keysRef.current, ...fresh].sort();
        setKeys(keysRef.current);
      }
      if (n) dirty.current = true;
    };
    const onLogs = (e: LogsEvent) => {
      const lastTs = logBuf.current.length ? (logBuf.current[logBuf.current.length - 1] as LogLine).ts : 0;
      for (const [rank, ts, text] of e.lines) {
        if (ts > lastTs) logBuf.current.push({ id: 0, attempt: e.attempt, rank, ts, text });
      }
      if (logBuf.current.length > LOG_KEEP) logBuf.current.splice(0, logBuf.current.length - LOG_KEEP);
    };

    (async () => {
      try {
        const r = await loadRun();
        const live = !TERMINAL.has(r.status);
        // Start the live stream a minute back (before the history is read), so nothing falls
        // between the two; points the history already holds are dropped by step.
        if (live) {
          stream = new RunStream(id, sinceAgo(60), {
            metrics: onMetrics,
            logs: onLogs,
            state: () => {
              void loadRun().then((nr) => {
                if (TERMINAL.has(nr.status)) void loadHistory(keysRef.current, nr.last_step);
              });
            },
          });
        }
        const k = ok(await api.GET("/api/v1/runs/{run_id}/metrics/keys", { params: { path: { run_id: id } } }));
        if (!alive) return;
        keysRef.current = [...new Set([...k, ...keysRef.current])].sort();
        setKeys(keysRef.current);
        const lines = ok(await api.GET("/api/v1/runs/{run_id}/logs", { params: { path: { run_id: id }, query: { limit: 10000 } } }));
        logBuf.current = [...lines.slice(-LOG_KEEP), ...logBuf.current.filter((l) => l.ts > (lines[lines.length - 1]?.ts ?? 0))];
        await loadHistory(keysRef.current, r.last_step);
      } catch (e) {
        if (alive) setError(e);
      }
    })();

    // Draw at most once per frame; refresh the tables a few times a second.
    let frame = 0;
    const tick = () => {
      if (dirty.current) {
        dirty.current = false;
        redraw();
      }
      frame = requestAnimationFrame(tick);
    };
    frame = requestAnimationFrame(tick);
    const slow = window.setInterval(() => {
      setRanks([...rankRef.current.values()].sort((a, b) => a.rank - b.rank));
      setLogs(logBuf.current.slice());
      setPoints(series.current.get("loss")?.length ?? 0);
    }, 400);
    return () => {
      alive = false;
      stream?.close();
      expose("series", null);
      expose("stream", null);
      cancelAnimationFrame(frame);
      window.clearInterval(slow);
    };
  }, [id, loadRun, loadHistory, redraw]);

  // New charts (keys, x mode) start empty: fill them now.
  useEffect(() => {
    dirty.current = true;
  }, [defs, time]);

  const onZoom = useCallback(
    async (a: number, b: number) => {
      let lo = a;
      let hi = b;
      if (timeRef.current) {
        const s = series.current.get(defsRef.current[0]?.keys[0] ?? "loss");
        if (!s || !s.length) return;
        const inside = s.x.filter((_, i) => (s.ts[i] as number) >= a && (s.ts[i] as number) <= b);
        if (!inside.length) return;
        lo = inside[0] as number;
        hi = inside[inside.length - 1] as number;
      }
      lo = Math.max(0, Math.floor(lo));
      hi = Math.ceil(hi);
      if (hi <= lo) return;
      setZoom([lo, hi]);
      zoomRef.current = [lo, hi];
      zoomSeries.current = null;
      const px = chartPx();
      const all = [...new Set(defsRef.current.flatMap((d) => d.keys))];
      const windowSeries = new Map<string, LiveSeries>();
      await Promise.all(
        all.map(async (key) => {
          const data = await fetchSeries(id, key, px, lo, hi);
          const r0 = Object.values(data.ranks)[0];
          const s = new LiveSeries(Infinity);
          const agg = data.aggregate;
          s.setHistory(agg.step, interpolate(agg.step, r0?.step ?? [], r0?.ts ?? []), agg.mean, agg.min, agg.max);
          windowSeries.set(key, s);
        }),
      );
      if (zoomRef.current?.[0] !== lo || zoomRef.current?.[1] !== hi) return;
      zoomSeries.current = windowSeries;
      redraw();
    },
    [id, redraw],
  );

  const resetZoom = () => {
    setZoom(null);
    zoomRef.current = null;
    zoomSeries.current = null;
    redraw();
  };

  const cancel = async () => {
    setCancelling(true);
    setActionError(null);
    try {
      ok(await api.POST("/api/v1/runs/{run_id}/cancel", { params: { path: { run_id: id } } }));
      await loadRun();
    } catch (e) {
      setActionError(e instanceof Error ? e.message : String(e));
    } finally {
      setCancelling(false);
    }
  };

  if (error !== undefined) return <ErrorBox error={error} retry={() => go(`#/runs/${id}?r=${Date.now()}`)} />;
  if (!run) return <Loading what={`Loading run ${id}`} />;

  const s = summary(run);
  const active = !TERMINAL.has(run.status);
  const slowest = ranks.reduce<RankRow | null>(
    (m, r) => ((r.values.step_time_s ?? -1) > (m?.values.step_time_s ?? -1) ? r : m),
    null,
  );
  const commKey = keys?.includes("exposed_comm_s") ? "exposed_comm_s" : keys?.includes("comm_time_s") ? "comm_time_s" : null;
  const shownLogs = logRank === "all" ? logs : logs.filter((l) => String(l.rank) === logRank);
  const logRanks = [...new Set(logs.map((l) => l.rank))].sort((a, b) => a - b);

  return (
    <section class="run-detail" data-testid="run-detail">
      <div class="page-head">
        <div>
          <div class="crumbs">
            <a href="#/runs">Runs</a> / #{run.id}
          </div>
          <h1>
            {run.name} <StatusBadge status={run.status} />
          </h1>
          <div class="muted spec-line">{specSummary(run)}</div>
          {run.status_reason && <div class="reason">{run.status_reason}</div>}
        </div>
        <div class="actions">
          {active && (
            <button class="btn btn-danger" onClick={cancel} disabled={cancelling || run.status === "cancelling"} data-testid="cancel-run">
              {cancelling || run.status === "cancelling" ? "Cancelling…" : "Cancel run"}
            </button>
          )}
          <a class="btn" href={`#/new?from=${run.id}`} data-testid="clone-run">
            Clone and edit
          </a>
        </div>
      </div>
      {actionError && <ErrorBox error={actionError} />}

      <div class="stats">
        <div class="stat">
          <span>Progress</span>
          <Progress value={run.last_step} total={s.steps} />
        </div>
        <div class="stat">
          <span>Duration</span>
          <strong>{fmtDuration(duration(run))}</strong>
        </div>
        <div class="stat">
          <span>Attempts</span>
          <strong>{run.attempt_count}</strong>
        </div>
        <div class="stat">
          <span>Nodes</span>
          <strong>{run.node_ids.join(", ") || "—"}</strong>
        </div>
      </div>

      <div class="toolbar">
        <div class="seg">
          <button class={!time ? "on" : ""} onClick={() => setTime(false)} data-testid="x-step">
            Step
          </button>
          <button class={time ? "on" : ""} onClick={() => setTime(true)} data-testid="x-time">
            Wall time
          </button>
        </div>
        {zoom ? (
          <span>
            Steps {zoom[0].toLocaleString("en-US")}–{zoom[1].toLocaleString("en-US")}{" "}
            <button class="btn btn-small" onClick={resetZoom} data-testid="reset-zoom">
              Reset zoom
            </button>
          </span>
        ) : (
          <span class="muted">Drag across a chart to zoom; the server sends the finer window.</span>
        )}
        <span class="muted right" data-testid="loss-points" data-points={points}>
          {active ? "live" : "final"}
        </span>
      </div>

      {keys === null ? (
        <Loading what="Loading metrics" />
      ) : defs.length === 0 ? (
        <div class="state state-empty">No metrics yet{active ? ": charts appear with the first step." : "."}</div>
      ) : (
        <div class="charts">
          {defs.map((def) => (
            <Chart
              key={`${def.id}:${def.labels.join(",")}`}
              title={def.title}
              series={seriesDefs(def)}
              time={time}
              syncKey={`run-${id}`}
              unit={def.unit}
              onZoom={onZoom}
              marks={attemptMarks(run?.attempts ?? [], time)}
              testId={`chart-${def.id.replace(/[^a-z0-9_-]/gi, "_")}`}
              handle={(h) => {
                if (h) charts.current.set(def.id, h);
                else charts.current.delete(def.id);
                dirty.current = true;
              }}
            />
          ))}
        </div>
      )}

      <div class="two">
        <div class="card">
          <h2>Ranks</h2>
          {ranks.length === 0 ? (
            <div class="state state-empty">No rank has reported yet.</div>
          ) : (
            <table class="table" data-testid="rank-table">
              <thead>
                <tr>
                  <th>Rank</th>
                  <th class="num">Step</th>
                  <th class="num">Step time</th>
                  <th class="num">{commKey === "exposed_comm_s" ? "Exposed comm" : "Comm time"}</th>
                  <th class="num">Samples/s</th>
                </tr>
              </thead>
              <tbody>
                {ranks.map((r) => (
                  <tr class={ranks.length > 1 && r === slowest ? "slowest" : ""} title={r === slowest ? "slowest rank" : ""}>
                    <td>
                      {r.rank}
                      {ranks.length > 1 && r === slowest && <span class="tag">slowest</span>}
                    </td>
                    <td class="num">{r.step.toLocaleString("en-US")}</td>
                    <td class="num">{fmtDuration(r.values.step_time_s)}</td>
                    <td class="num">{commKey ? fmtDuration(r.values[commKey]) : "—"}</td>
                    <td class="num">{fmtSI(r.values.samples_per_s)}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          )}
        </div>
        <div class="card">
          <h2>State history</h2>
          <table class="table" data-testid="events">
            <tbody>
              {events.map((e) => (
                <tr>
                  <td class="muted nowrap">{fmtClock(e.at)}</td>
                  <td>
                    <StatusBadge status={e.to_status} />
                  </td>
                  <td class="reason-cell">
                    <pre>{e.reason}</pre>
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      </div>

      <Checkpoints id={id} active={active} status={run.status} />

      {(run.spec as { training?: { profile_every?: number } }).training?.profile_every ? (
        <SampledStep id={id} active={active} status={run.status} />
      ) : null}

      <div class="card">
        <div class="card-head">
          <h2>Logs</h2>
          <select value={logRank} onChange={(e) => setLogRank((e.target as HTMLSelectElement).value)} data-testid="log-rank">
            <option value="all">All ranks</option>
            {logRanks.map((r) => (
              <option value={String(r)}>{r === -1 ? "launcher" : `rank ${r}`}</option>
            ))}
          </select>
        </div>
        {shownLogs.length === 0 ? (
          <div class="state state-empty">No log lines{active ? " yet" : ""}.</div>
        ) : (
          <LogView lines={shownLogs} />
        )}
      </div>

      <div class="card">
        <h2>Spec</h2>
        <pre class="json" data-testid="spec-json">{JSON.stringify(run.spec, null, 2)}</pre>
      </div>
    </section>
  );
}

function LogView({ lines }: { lines: LogLine[] }) {
  const box = useRef<HTMLPreElement>(null);
  useEffect(() => {
    const el = box.current;
    if (el && el.scrollHeight - el.scrollTop - el.clientHeight < 80) el.scrollTop = el.scrollHeight;
  }, [lines]);
  return (
    <pre class="logs" ref={box} data-testid="logs">
      {lines.slice(-500).map((l) => (
        <div>
          <span class="muted">{fmtTs(l.ts)}</span> <span class="rank">[{l.rank === -1 ? "agent" : l.rank}]</span> {l.text}
        </div>
      ))}
    </pre>
  );
}
