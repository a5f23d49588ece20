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
import { RunHead } from "../components/RunHead";
import { LogsCard, RankTable, StateHistory, type RankRow } from "../components/RunTables";
import { ErrorBox, Loading } from "../components/ui";
import { LiveSeries, lastValue } from "../lib/data";
import { expose } from "../lib/debug";
import { go } from "../lib/route";
import { attemptMarks, chartData, chartDefs, setHistoryFrom, type ChartDef } from "../lib/runview";
import { RunStream, TERMINAL, sinceAgo } from "../lib/stream";
import { summary } from "./Runs";

const LOG_KEEP = 1000;
const RANK_KEYS = ["step_time_s", "comm_time_s", "exposed_comm_s", "samples_per_s"];

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

export function RunDetail({ id }: { id: number }) {
  const [run, setRun] = useState<Run | null>(null);
  const [error, setError] = useState<unknown>(undefined);
  const [events, setEvents] = useState<RunEvent[]>([]);
  const [keys, setKeys] = useState<string[] | null>(null);
  const [logs, setLogs] = useState<LogLine[]>([]);
  const [ranks, setRanks] = useState<RankRow[]>([]);
  const [time, setTime] = useState(false);
  const [zoom, setZoom] = useState<[number, number] | null>(null);
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
          series.current.set(key, setHistoryFrom(series.current.get(key) ?? new LiveSeries(), full));
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
          windowSeries.set(key, setHistoryFrom(new LiveSeries(Infinity), await fetchSeries(id, key, px, lo, hi)));
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

  if (error !== undefined) return <ErrorBox error={error} retry={() => go(`#/runs/${id}?r=${Date.now()}`)} />;
  if (!run) return <Loading what={`Loading run ${id}`} />;

  const active = !TERMINAL.has(run.status);

  return (
    <section class="run-detail" data-testid="run-detail">
      <RunHead run={run} onChange={loadRun} />

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
        <RankTable ranks={ranks} keys={keys ?? []} />
        <StateHistory events={events} />
      </div>

      <Checkpoints id={id} active={active} status={run.status} />

      {(run.spec as { training?: { profile_every?: number } }).training?.profile_every ? (
        <SampledStep id={id} active={active} status={run.status} />
      ) : null}

      <LogsCard lines={logs} active={active} />

      <div class="card">
        <h2>Spec</h2>
        <pre class="json" data-testid="spec-json">{JSON.stringify(run.spec, null, 2)}</pre>
      </div>
    </section>
  );
}
