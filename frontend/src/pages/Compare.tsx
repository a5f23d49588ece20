import { useEffect, useRef, useState } from "preact/hooks";
import { api, fetchSeries, ok, type MetricSeries, type Run } from "../api/client";
import { Chart, PALETTE, type ChartHandle } from "../components/Chart";
import { ChartControls } from "../components/ChartControls";
import { Empty, ErrorBox, Loading, StatusBadge, usePoll } from "../components/ui";
import { present, seriesFor, throughput, type Columns } from "../lib/chartdata";
import { alignSeries, specTable, type Num } from "../lib/data";
import { fmtBytes, fmtDuration, fmtNumber, fmtPercent, fmtSI } from "../lib/format";
import { TERMINAL } from "../lib/states";
import { loadPrefs, savePrefs, type Prefs } from "../lib/prefs";
import { go, type Route } from "../lib/route";
import { summary } from "./Runs";

interface Loaded {
  runs: Run[];
  loss: (MetricSeries | null)[];
  thr: (MetricSeries | null)[]; // step_time_s (samples_per_s for a script: its batch is its own)
}

/** Each run's throughput per step, by the run page's definition (lib/chartdata.ts throughput). */
function throughputSeries(run: Run, s: MetricSeries | null): { x: number[]; y: Num[] } {
  const x = s?.aggregate.step ?? [];
  if (run.spec.workload.kind === "script") {
    const world = summary(run).world;
    return { x, y: (s?.aggregate.mean ?? []).map((v) => (v === null ? null : v * world)) };
  }
  return { x, y: throughput(s?.aggregate.max ?? [], run.spec.training?.batch_size ?? 64) };
}

async function maybe(p: Promise<MetricSeries>): Promise<MetricSeries | null> {
  try {
    return await p;
  } catch {
    return null;
  }
}

function Picker({ initial }: { initial: number[] }) {
  const [picked, setPicked] = useState<number[]>(initial);
  const { data, error } = usePoll(async () => ok(await api.GET("/api/v1/runs", { params: { query: { limit: 100 } } })), []);
  if (error !== undefined) return <ErrorBox error={error} />;
  if (!data) return <Loading what="Loading runs" />;
  if (data.items.length < 2) return <Empty>Compare needs at least two runs.</Empty>;
  return (
    <div class="card">
      <p class="muted">Pick 2 to 6 runs.</p>
      <div class="pick-list">
        {data.items.map((r) => (
          <label class="pick">
            <input
              type="checkbox"
              checked={picked.includes(r.id)}
              disabled={!picked.includes(r.id) && picked.length >= 6}
              onChange={() => setPicked((p) => (p.includes(r.id) ? p.filter((x) => x !== r.id) : [...p, r.id]))}
              data-testid={`pick-${r.id}`}
            />
            #{r.id} {r.name} <StatusBadge status={r.status} />
          </label>
        ))}
      </div>
      <button class="btn btn-primary" disabled={picked.length < 2} onClick={() => go(`#/compare?ids=${picked.join(",")}`)} data-testid="compare-go">
        Compare {picked.length} runs
      </button>
    </div>
  );
}

const MAX_COMPARED = 10; // a strategy comparison queues up to 8 runs
const REFRESH_MS = 5000; // while a compared run is unfinished, its figures are read again

export function Compare({ route }: { route: Route }) {
  const ids = (route.query.get("ids") ?? "")
    .split(",")
    .map(Number)
    .filter((n) => Number.isInteger(n) && n > 0)
    .slice(0, MAX_COMPARED);
  const [data, setData] = useState<Loaded | null>(null);
  const [prefs, setPrefs] = useState<Prefs>(loadPrefs);
  const [error, setError] = useState<unknown>(undefined);
  const lossChart = useRef<ChartHandle | null>(null);
  const thrChart = useRef<ChartHandle | null>(null);
  const key = ids.join(",");
  const [tick, setTick] = useState(0);

  useEffect(() => {
    if (ids.length < 2) return;
    if (tick === 0) setData(null); // a refresh keeps the page as it was until the new figures come
    setError(undefined);
    const px = Math.max(300, Math.floor(window.innerWidth / 2));
    (async () => {
      const runs = await Promise.all(ids.map(async (id) => ok(await api.GET("/api/v1/runs/{run_id}", { params: { path: { run_id: id } } }))));
      const [loss, thr] = await Promise.all([
        Promise.all(ids.map((id) => maybe(fetchSeries(id, "loss", px)))),
        Promise.all(runs.map((r) => maybe(fetchSeries(r.id, r.spec.workload.kind === "script" ? "samples_per_s" : "step_time_s", px)))),
      ]);
      setData({ runs, loss, thr });
    })().catch(setError);
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [key, tick]);
  const unfinished = data?.runs.some((r) => !TERMINAL.has(r.status)) ?? false;
  useEffect(() => {
    if (!unfinished) return;
    const timer = setTimeout(() => setTick((t) => t + 1), REFRESH_MS);
    return () => clearTimeout(timer);
  }, [unfinished, data]);

  useEffect(() => {
    if (!data) return;
    const draw = (chart: ChartHandle | null, lines: { x: number[]; y: Num[] }[]) =>
      chart?.setData(present("lines", alignSeries(lines) as Columns, prefs).data);
    draw(lossChart.current, data.loss.map((s) => ({ x: s?.aggregate.step ?? [], y: s?.aggregate.mean ?? [] })));
    draw(thrChart.current, data.thr.map((s, i) => throughputSeries(data.runs[i] as Run, s)));
  }, [data, prefs]);

  if (ids.length < 2) {
    return (
      <section>
        <div class="page-head">
          <h1>Compare runs</h1>
        </div>
        <Picker initial={ids} />
      </section>
    );
  }
  if (error !== undefined) return <ErrorBox error={error} />;
  if (!data) return <Loading what="Loading runs to compare" />;

  const labels = data.runs.map((r) => `#${r.id} ${r.name}`);
  const rows = specTable(data.runs.map((r) => r.spec));
  const lines = seriesFor("lines", labels, prefs);
  return (
    <section data-testid="compare">
      <div class="page-head">
        <h1>Compare runs</h1>
        <div class="actions">
          <a class="btn" href="#/compare">
            Pick other runs
          </a>
        </div>
      </div>
      <div class="card">
        <h2>Summary</h2>
        <table class="table" data-testid="compare-summary">
          <thead>
            <tr>
              <th>Run</th>
              <th>Status</th>
              <th class="num" title="global batch / the slowest rank's step time, at the last step">Samples/s (last step)</th>
              <th class="num" title="global batch / mean step time, over the run">Samples/s (mean)</th>
              <th class="num" title="exposed comm / step time, mean over ranks and steps">Comm fraction (mean)</th>
              <th class="num" title="bytes a rank's collectives moved per step, mean over ranks and steps">Comm bytes/step</th>
              <th class="num" title="the highest of any rank: CUDA's max allocated, else the process's max RSS">Peak memory/rank</th>
              <th class="num">Final loss</th>
              <th class="num">Best loss</th>
              <th class="num">Wall time</th>
            </tr>
          </thead>
          <tbody>
            {data.runs.map((r, i) => (
              <tr data-run={r.id}>
                <td>
                  <span class="swatch" style={{ background: PALETTE[i % PALETTE.length] }} />
                  <a href={`#/runs/${r.id}`}>{labels[i]}</a>
                </td>
                <td>
                  <StatusBadge status={r.status} />
                </td>
                <td class="num" data-testid="last-throughput">{fmtSI(r.samples_per_s)}</td>
                <td class="num" data-testid="mean-throughput">{fmtSI(r.summary?.mean_samples_per_s)}</td>
                <td class="num" data-testid="mean-comm">{fmtPercent(r.summary?.mean_comm_fraction)}</td>
                <td class="num" data-testid="mean-comm-bytes">{fmtBytes(r.summary?.mean_comm_bytes)}</td>
                <td class="num" data-testid="peak-memory">{fmtBytes(r.summary?.peak_memory_bytes)}</td>
                <td class="num" data-testid="final-loss">{fmtNumber(r.summary?.final_loss, 4)}</td>
                <td class="num" data-testid="best-loss">{fmtNumber(r.summary?.best_loss, 4)}</td>
                <td class="num">{fmtDuration(r.summary?.wall_time_s)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      </div>
      <ChartControls prefs={prefs} onChange={(change) => setPrefs(savePrefs(change))} perRank={false} />
      <div class="charts">
        <Chart title="Loss (mean over ranks)" series={lines} logY={prefs.logY} syncKey="compare" testId="compare-loss"
          handle={(h) => {
            lossChart.current = h;
          }} />
        <Chart title="Throughput (samples/s)" help="global batch / each step's slowest rank's step time" series={lines} logY={prefs.logY} syncKey="compare" testId="compare-throughput"
          handle={(h) => {
            thrChart.current = h;
          }} />
      </div>
      <div class="card">
        <h2>Specs</h2>
        <table class="table spec-diff" data-testid="spec-diff">
          <thead>
            <tr>
              <th>Field</th>
              {labels.map((l) => (
                <th>{l}</th>
              ))}
            </tr>
          </thead>
          <tbody>
            {rows.map((row) => (
              <tr class={row.differs ? "differs" : ""}>
                <td class="mono">{row.path}</td>
                {row.values.map((v) => (
                  <td class="mono">{v ?? "—"}</td>
                ))}
              </tr>
            ))}
          </tbody>
        </table>
      </div>
    </section>
  );
}
