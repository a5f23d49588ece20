import { useEffect, useRef, useState } from "preact/hooks";
import { api, fetchSeries, ok, type MetricSeries, type Run } from "../api/client";
import { Chart, PALETTE, type ChartHandle } from "../components/Chart";
import { Empty, ErrorBox, Loading, StatusBadge, usePoll } from "../components/ui";
import { alignSeries, lastValue, mean, specTable } from "../lib/data";
import { fmtNumber, fmtPercent, fmtSI } from "../lib/format";
import { go, type Route } from "../lib/route";
import { summary } from "./Runs";

interface Loaded {
  runs: Run[];
  loss: (MetricSeries | null)[];
  thr: (MetricSeries | null)[];
  comm: (MetricSeries | null)[];
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

export function Compare({ route }: { route: Route }) {
  const ids = (route.query.get("ids") ?? "")
    .split(",")
    .map(Number)
    .filter((n) => Number.isInteger(n) && n > 0)
    .slice(0, 6);
  const [data, setData] = useState<Loaded | null>(null);
  const [error, setError] = useState<unknown>(undefined);
  const lossChart = useRef<ChartHandle | null>(null);
  const thrChart = useRef<ChartHandle | null>(null);
  const key = ids.join(",");

  useEffect(() => {
    if (ids.length < 2) return;
    setData(null);
    setError(undefined);
    const px = Math.max(300, Math.floor(window.innerWidth / 2));
    (async () => {
      const runs = await Promise.all(ids.map(async (id) => ok(await api.GET("/api/v1/runs/{run_id}", { params: { path: { run_id: id } } }))));
      const [loss, thr, comm] = await Promise.all(
        ["loss", "samples_per_s", "comm_fraction"].map((k) => Promise.all(ids.map((id) => maybe(fetchSeries(id, k, px))))),
      );
      setData({ runs, loss: loss ?? [], thr: thr ?? [], comm: comm ?? [] });
    })().catch(setError);
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [key]);

  useEffect(() => {
    if (!data) return;
    const world = data.runs.map((r) => summary(r).world);
    lossChart.current?.setData(alignSeries(data.loss.map((s) => ({ x: s?.aggregate.step ?? [], y: s?.aggregate.mean ?? [] }))));
    thrChart.current?.setData(
      alignSeries(
        data.thr.map((s, i) => ({
          x: s?.aggregate.step ?? [],
          y: (s?.aggregate.mean ?? []).map((v) => (v === null ? null : v * (world[i] ?? 1))),
        })),
      ),
    );
  }, [data]);

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
  const world = data.runs.map((r) => summary(r).world);
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
              <th class="num">Mean samples/s</th>
              <th class="num">Comm fraction</th>
              <th class="num">Final loss</th>
            </tr>
          </thead>
          <tbody>
            {data.runs.map((r, i) => {
              const thr = mean(data.thr[i]?.aggregate.mean ?? []);
              return (
                <tr>
                  <td>
                    <span class="swatch" style={{ background: PALETTE[i % PALETTE.length] }} />
                    <a href={`#/runs/${r.id}`}>{labels[i]}</a>
                  </td>
                  <td>
                    <StatusBadge status={r.status} />
                  </td>
                  <td class="num">{fmtSI(thr === null ? null : thr * (world[i] ?? 1))}</td>
                  <td class="num">{fmtPercent(mean(data.comm[i]?.aggregate.mean ?? []))}</td>
                  <td class="num">{fmtNumber(lastValue(data.loss[i]?.aggregate.mean ?? []), 4)}</td>
                </tr>
              );
            })}
          </tbody>
        </table>
      </div>
      <div class="charts">
        <Chart title="Loss (mean over ranks)" series={labels.map((l) => ({ label: l }))} syncKey="compare" testId="compare-loss"
          handle={(h) => {
            lossChart.current = h;
          }} />
        <Chart title="Throughput (samples/s, all ranks)" series={labels.map((l) => ({ label: l }))} syncKey="compare" testId="compare-throughput"
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
