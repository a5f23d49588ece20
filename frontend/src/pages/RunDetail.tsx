import { useCallback, useEffect, useMemo, useRef, useState } from "preact/hooks";
import { api, fetchSeries, ok, type IngestedEvent, type LogsEvent, type MetricsEvent, type Run, type RunEvent } from "../api/client";
import { Chart, type ChartHandle } from "../components/Chart";
import { ChartControls, Downloads } from "../components/ChartControls";
import { ChartSections } from "../components/ChartSections";
import { Diagnosis } from "../components/Diagnosis";
import { Checkpoints, SampledStep } from "../components/RunCards";
import { RunHead } from "../components/RunHead";
import { LOG_PAGE, LogsCard, readFailureEarly, readTail } from "../components/RunLogs";
import { RankTable, StateHistory, type RankRow } from "../components/RunTables";
import { Scaling } from "../components/Scaling";
import { Stragglers } from "../components/Stragglers";
import { ErrorBox, Loading } from "../components/ui";
import { chartData, present, rankData, RANK_BUDGET, seriesFor, setHistoryFrom, setRankHistoryFrom } from "../lib/chartdata";
import { LiveSeries, lastValue } from "../lib/data";
import { expose } from "../lib/debug";
import { LogBuffer } from "../lib/logs";
import { loadPrefs, savePrefs, type Prefs } from "../lib/prefs";
import { go } from "../lib/route";
import { attemptMarks, chartDefs, MAX_KEY_CHARTS, MAX_LIVE_KEYS, MAX_RANK_LINES, otherKeys, type ChartDef, type RunShape } from "../lib/runview";
import { TERMINAL } from "../lib/states";
import { RunStream, sinceAgo } from "../lib/stream";
import { summary } from "./Runs";

const RANK_KEYS = ["step_time_s", "comm_time_s", "exposed_comm_s", "samples_per_s"];
const RUN_POLL_MS = 5000; // the run's figures (header) while it is live

// benchmarks/dashboard.py sets window.__tyPerf = [] to collect each redraw's milliseconds, and
// window.__tyPaint = [] for each redraw's latency: from the newest loss point's own time stamp to
// the animation frame after the charts drew it (seconds).
const perf = (window as unknown as { __tyPerf?: number[] }).__tyPerf;
const paint = (window as unknown as { __tyPaint?: number[] }).__tyPaint;

type RankSeries = Map<string, Map<number, LiveSeries>>; // key → rank → that rank's own series

function chartPx(): number {
  return Math.max(300, Math.floor((Math.min(window.innerWidth, 1800) - 96) / 2));
}

function runShape(run: Run): RunShape {
  const { workload, training } = run.spec;
  const seqLen = workload.kind === "builtin" && workload.name === "charlm" ? (workload.params?.seq_len ?? 64) : null;
  return { world: summary(run).world, batch: workload.kind === "script" ? null : (training?.batch_size ?? 64), seqLen };
}

/** Draw ``def`` one line per rank? Only where it has a per-rank key and the viewer asked. */
function perRankOf(def: ChartDef, prefs: Prefs): string | null {
  return prefs.perRank && def.perRankKey ? def.perRankKey : null;
}

function rankMap(all: RankSeries, key: string): Map<number, LiveSeries> {
  let m = all.get(key);
  if (!m) all.set(key, (m = new Map()));
  return m;
}

export function RunDetail({ id }: { id: number }) {
  const [run, setRun] = useState<Run | null>(null);
  const [error, setError] = useState<unknown>(undefined);
  const [events, setEvents] = useState<RunEvent[]>([]);
  const [keys, setKeys] = useState<string[] | null>(null);
  const [stragglers, setStragglers] = useState<number[]>([]); // named by the Stragglers card, marked in the Ranks table
  const [ranks, setRanks] = useState<RankRow[]>([]);
  const [stored, setStored] = useState<IngestedEvent | null>(null);
  const [rankIds, setRankIds] = useState<number[]>([]);
  const [time, setTime] = useState(false);
  const [zoom, setZoom] = useState<[number, number] | null>(null);
  const [points, setPoints] = useState(0);
  const [prefs, setPrefs] = useState<Prefs>(loadPrefs);
  const [logVersion, setLogVersion] = useState(0);

  const series = useRef(new Map<string, LiveSeries>());
  const rankSeries = useRef<RankSeries>(new Map());
  const charts = useRef(new Map<string, ChartHandle>());
  const rankRef = useRef(new Map<number, RankRow>());
  // Set by the stream when a rank's row changed: the table is rebuilt then, not on every tick (a
  // new array each 400 ms re-rendered the page 2.5 times a second, a finished run's too).
  const ranksChanged = useRef(false);
  const logs = useRef(new LogBuffer());
  const dirty = useRef(false);
  const zoomRef = useRef<[number, number] | null>(null);
  const zoomSeries = useRef<{ all: Map<string, LiveSeries>; ranks: RankSeries } | null>(null); // the server's finer window
  const keysRef = useRef<string[]>([]);
  const timeRef = useRef(false);
  const prefsRef = useRef(prefs);
  const rankIdsRef = useRef<number[]>([]);
  zoomRef.current = zoom;
  timeRef.current = time;
  prefsRef.current = prefs;
  rankIdsRef.current = rankIds;

  const shape = useMemo(() => (run ? runShape(run) : { world: 1, batch: 64, seqLen: null }), [run?.id]); // eslint-disable-line react-hooks/exhaustive-deps
  const defs = useMemo(() => chartDefs(keys ?? [], shape), [keys, shape]);
  const hiddenCharts = Math.max(0, otherKeys(keys ?? []).length - MAX_KEY_CHARTS);
  const defsRef = useRef(defs);
  defsRef.current = defs;

  const changePrefs = (change: Partial<Prefs>) => setPrefs(savePrefs(change));

  const redraw = useCallback(() => {
    // A zoomed window shows the server's finer data, not the live tail.
    const source = zoomRef.current ? zoomSeries.current : { all: series.current, ranks: rankSeries.current };
    if (!source) return;
    const t0 = performance.now();
    for (const def of defsRef.current) {
      const chart = charts.current.get(def.id);
      if (!chart) continue;
      const perRankKey = perRankOf(def, prefsRef.current);
      const base = perRankKey
        ? rankData(source.ranks.get(perRankKey) ?? new Map(), rankIdsRef.current, timeRef.current)
        : chartData(def, source.all, timeRef.current);
      const { data, shown } = present(perRankKey ? "lines" : def.kind, base, prefsRef.current);
      chart.setData(data, shown);
    }
    perf?.push(performance.now() - t0);
    const stamps = source.all.get("loss")?.ts;
    const newest = stamps?.[stamps.length - 1];
    if (paint && newest) requestAnimationFrame(() => paint.push(Date.now() / 1000 - newest));
  }, []);

  const loadRun = useCallback(async () => {
    const r = ok(await api.GET("/api/v1/runs/{run_id}", { params: { path: { run_id: id } } }));
    // the live stream may be ahead of the stored last step
    setRun((prev) => (prev?.id === r.id && prev.last_step > r.last_step ? { ...r, last_step: prev.last_step } : r));
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
          setRankHistoryFrom(rankMap(rankSeries.current, key), full, MAX_RANK_LINES);
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
    rankSeries.current = new Map();
    rankRef.current = new Map();
    ranksChanged.current = true; // another run: its table starts empty
    logs.current = new LogBuffer();
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
            if (keysRef.current.length >= MAX_LIVE_KEYS && !keysRef.current.includes(key)) continue;
            s = new LiveSeries();
            series.current.set(key, s);
            if (!keysRef.current.includes(key)) (fresh ??= []).push(key);
          }
          if (s.add(step, ts, value)) n++;
          if (e.rank < MAX_RANK_LINES) {
            const byRank = rankMap(rankSeries.current, key);
            let own = byRank.get(e.rank);
            if (!own) byRank.set(e.rank, (own = new LiveSeries(RANK_BUDGET)));
            own.add(step, ts, value);
          }
          if (step >= row.step && RANK_KEYS.includes(key)) row.values[key] = value;
        }
        row.step = Math.max(row.step, step);
      }
      rankRef.current.set(e.rank, row);
      ranksChanged.current = true;
      if (fresh) {
        keysRef.current = [...keysRef.current, ...fresh].sort();
        setKeys(keysRef.current);
      }
      if (n) dirty.current = true;
    };
    const onLogs = (e: LogsEvent) => logs.current.append(e.lines.map(([rank, ts, text]) => ({ id: 0, attempt: e.attempt, rank, ts, text })));

    (async () => {
      try {
        const r = await loadRun();
        if (r.status === "failed") readFailureEarly(id);
        const live = !TERMINAL.has(r.status);
        // Start the live stream a minute back (before the history is read), so nothing falls
        // between the two; points the history already holds are dropped by step.
        if (live) {
          stream = new RunStream(id, sinceAgo(60), {
            metrics: onMetrics,
            logs: onLogs,
            ingested: setStored,
            state: () => {
              // the api may be going away as the event arrives: the banner says so, the next poll reads it
              loadRun()
                .then((nr) => (TERMINAL.has(nr.status) ? loadHistory(keysRef.current, nr.last_step) : undefined))
                .catch(() => undefined);
            },
          });
        }
        const k = ok(await api.GET("/api/v1/runs/{run_id}/metrics/keys", { params: { path: { run_id: id } } }));
        if (!alive) return;
        keysRef.current = [...new Set([...k, ...keysRef.current])].sort();
        setKeys(keysRef.current);
        logs.current.setTail(await readTail(id), LOG_PAGE); // the end of the log: a failure's traceback
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
      if (ranksChanged.current) {
        ranksChanged.current = false;
        setRanks([...rankRef.current.values()].sort((a, b) => a.rank - b.rank));
      }
      // the progress follows the live stream, not only the run as first read
      const newest = Math.max(0, ...[...rankRef.current.values()].map((row) => row.step));
      setRun((r) => (r && newest > r.last_step ? { ...r, last_step: newest } : r));
      setLogVersion(logs.current.version);
      setPoints(series.current.get("loss")?.length ?? 0);
      const seen = [...new Set([...rankSeries.current.values()].flatMap((m) => [...m.keys()]))].sort((a, b) => a - b);
      if (seen.join() !== rankIdsRef.current.join()) setRankIds(seen);
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

  // While the run is live its figures (the header) are read again every few seconds.
  const live = run !== null && !TERMINAL.has(run.status);
  useEffect(() => {
    if (!live) return;
    const timer = window.setInterval(() => void loadRun().catch(() => undefined), RUN_POLL_MS);
    return () => window.clearInterval(timer);
  }, [live, loadRun]);

  // New charts (keys, x mode, view settings) start empty: fill them now.
  useEffect(() => {
    dirty.current = true;
  }, [defs, time, prefs, rankIds]);

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
      const wanted = [...new Set(defsRef.current.flatMap((d) => [...d.keys, ...(d.perRankKey ? [d.perRankKey] : [])]))];
      const window_ = { all: new Map<string, LiveSeries>(), ranks: new Map() as RankSeries };
      await Promise.all(
        wanted.map(async (key) => {
          const got = await fetchSeries(id, key, px, lo, hi);
          window_.all.set(key, setHistoryFrom(new LiveSeries(Infinity), got));
          setRankHistoryFrom(rankMap(window_.ranks, key), got, MAX_RANK_LINES);
        }),
      );
      if (zoomRef.current?.[0] !== lo || zoomRef.current?.[1] !== hi) return;
      zoomSeries.current = window_;
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
  const marks = attemptMarks(run.attempts ?? [], time);

  const chart = (def: ChartDef) => {
    const perRankKey = perRankOf(def, prefs);
    const labels = perRankKey ? rankIds.map((r) => `rank ${r}`) : def.labels;
    const downloads = [...new Set([...def.keys, ...(def.perRankKey ? [def.perRankKey] : [])])].filter((k) => keys?.includes(k));
    return (
      <Chart
        key={def.id}
        title={perRankKey && perRankKey !== def.keys[0] ? `${def.title} — per rank: ${perRankKey}` : def.title}
        help={def.help}
        series={seriesFor(perRankKey ? "lines" : def.kind, labels, prefs)}
        time={time}
        logY={prefs.logY}
        format={def.format}
        syncKey={`run-${id}`}
        onZoom={onZoom}
        marks={marks}
        testId={`chart-${def.id.replace(/[^a-z0-9_-]/gi, "_")}`}
        drawnMark={def.id === "loss" ? "ty:loss-drawn" : undefined}
        actions={<Downloads runId={id} keys={downloads} />}
        handle={(h) => {
          if (h) charts.current.set(def.id, h);
          else charts.current.delete(def.id);
          dirty.current = true;
        }}
      />
    );
  };

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
        <ChartControls prefs={prefs} onChange={changePrefs} perRank={shape.world > 1} />
        {zoom ? (
          <span>
            Steps {zoom[0].toLocaleString("en-US")}–{zoom[1].toLocaleString("en-US")}{" "}
            <button class="btn btn-small" onClick={resetZoom} data-testid="reset-zoom">
              Reset zoom
            </button>
          </span>
        ) : (
          <span class="muted">Drag across a chart to zoom.</span>
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
        <>
          {hiddenCharts > 0 && (
            <div class="muted" data-testid="hidden-charts">
              {hiddenCharts} more metric keys are not charted here (the first {MAX_KEY_CHARTS} are): read them with
              GET /api/v1/runs/{id}/metrics?key=…
            </div>
          )}
          <ChartSections
            defs={defs}
            collapsed={prefs.collapsed}
            onToggle={(section, fold) => changePrefs({ collapsed: { ...prefs.collapsed, [section]: fold } })}
            chart={chart}
          />
        </>
      )}

      <div class="two">
        <RankTable ranks={ranks} keys={keys ?? []} stored={active ? stored : null} stragglers={shape.world > 1 ? stragglers : []} />
        <StateHistory events={events} />
      </div>

      {shape.world > 1 ? <Stragglers id={id} active={active} status={run.status} onNamed={setStragglers} /> : null}
      {shape.world > 1 && !active ? <Scaling id={id} status={run.status} /> : null}
      <Diagnosis id={id} status={run.status} />
      <Checkpoints id={id} active={active} status={run.status} />

      {run.spec.training?.profile_every ? <SampledStep id={id} active={active} status={run.status} /> : null}

      <LogsCard runId={id} buffer={logs.current} version={logVersion} active={active} failed={run.status === "failed"} />

      <div class="card">
        <h2>Spec</h2>
        <pre class="json" data-testid="spec-json">{JSON.stringify(run.spec, null, 2)}</pre>
      </div>
    </section>
  );
}
