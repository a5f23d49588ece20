// Cards of the run page that read their own endpoint: checkpoints and the sampled step.
import { useState } from "preact/hooks";
import { api, ok } from "../api/client";
import { fmtBytes, fmtClock } from "../lib/format";
import { timelineRows } from "../lib/timeline";
import { ErrorBox, Loading, usePoll } from "./ui";

const POLL_MS = 10_000;

/** The run's complete checkpoints (read from the checkpoint root by the api), each downloadable as a
 * tar (the session cookie authorises the plain link). Re-read on each state change and, while the
 * run is live, every 10 s: a checkpoint is every N steps, not every frame. */
export function Checkpoints({ id, active, status }: { id: number; active: boolean; status: string }) {
  const { data: items, error } = usePoll(
    async () => ok(await api.GET("/api/v1/runs/{run_id}/checkpoints", { params: { path: { run_id: id } } })),
    [id, status, active],
    active ? POLL_MS : undefined,
  );

  return (
    <div class="card" data-testid="checkpoints">
      <h2>Checkpoints</h2>
      {error ? (
        <ErrorBox error={error} />
      ) : items === undefined ? (
        <Loading what="Loading checkpoints" />
      ) : items.length === 0 ? (
        <div class="state state-empty">No checkpoints{active ? " yet" : ""}.</div>
      ) : (
        <table class="table">
          <thead>
            <tr>
              <th class="num">Step</th>
              <th class="num">Size</th>
              <th class="num">Files</th>
              <th>Saved</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {items
              .slice()
              .reverse()
              .map((c) => (
                <tr data-step={c.step}>
                  <td class="num">{c.step.toLocaleString("en-US")}</td>
                  <td class="num">{fmtBytes(c.size_bytes)}</td>
                  <td class="num">{c.files}</td>
                  <td class="muted nowrap">{fmtClock(c.created_at)}</td>
                  <td>
                    <a class="btn btn-small" href={`/api/v1/runs/${id}/checkpoints/${c.step}/download`} download>
                      Download
                    </a>
                  </td>
                </tr>
              ))}
          </tbody>
        </table>
      )}
    </div>
  );
}

const LANE_PX = 18;
const ms = (seconds: number | undefined) => (seconds === undefined ? "—" : `${(seconds * 1e3).toFixed(2)} ms`);

/** The latest (or a chosen) step sampled with torch.profiler: every rank's compute and
 * communication spans on one axis, with the trace's own comm / exposed / overlap figures. */
export function SampledStep({ id, active, status }: { id: number; active: boolean; status: string }) {
  const { data: listed, error: listError } = usePoll(
    async () => ok(await api.GET("/api/v1/runs/{run_id}/profiles", { params: { path: { run_id: id } } })),
    [id, status, active],
    active ? POLL_MS : undefined,
  );
  const [chosen, setChosen] = useState<number | null>(null);
  const steps = listed?.map((s) => s.step) ?? null;
  const step = chosen ?? steps?.[0] ?? null;
  const { data, error: stepError } = usePoll(
    async () =>
      step === null
        ? null
        : ok(await api.GET("/api/v1/runs/{run_id}/profiles/{step}", { params: { path: { run_id: id, step } } })),
    [id, step],
  );
  const error = listError ?? stepError;
  const layout = data ? timelineRows(data) : null;
  return (
    <div class="card" data-testid="sampled-step">
      <div class="card-head">
        <h2>Sampled step (torch.profiler)</h2>
        {steps && steps.length > 0 ? (
          <select
            value={String(step)}
            onChange={(e) => setChosen(Number((e.target as HTMLSelectElement).value))}
            data-testid="sampled-step-select"
          >
            {steps.map((s) => (
              <option value={String(s)}>step {s.toLocaleString("en-US")}</option>
            ))}
          </select>
        ) : null}
      </div>
      {error ? (
        <ErrorBox error={error} />
      ) : steps === null ? (
        <Loading what="Loading sampled steps" />
      ) : steps.length === 0 || !data || !layout ? (
        <div class="state state-empty">No sampled step{active ? " yet" : ""}.</div>
      ) : (
        <>
          <table class="table">
            <thead>
              <tr>
                <th class="num">Rank</th>
                <th class="num">Comm</th>
                <th class="num">Exposed comm</th>
                <th class="num">Overlap</th>
                <th class="num">Compute</th>
              </tr>
            </thead>
            <tbody>
              {Object.entries(data.ranks).map(([rank, t]) => (
                <tr data-rank={rank}>
                  <td class="num">{rank}</td>
                  <td class="num">{ms(t.figures.prof_comm_time_s)}</td>
                  <td class="num">{ms(t.figures.prof_exposed_comm_s)}</td>
                  <td class="num">{((t.figures.prof_overlap_fraction ?? 0) * 100).toFixed(0)} %</td>
                  <td class="num">{ms(t.figures.prof_compute_time_s)}</td>
                </tr>
              ))}
            </tbody>
          </table>
          <div class="timeline" data-testid="timeline">
            {layout.rows.map((row) => (
              <div class="timeline-row">
                <span class="timeline-label muted">
                  rank {row.rank} · {row.kind} · {row.label}
                  {row.dropped ? ` (+${row.dropped} short)` : ""}
                </span>
                <svg class="timeline-lane" viewBox={`0 0 1000 ${LANE_PX}`} preserveAspectRatio="none" height={LANE_PX}>
                  {row.rects.map((r) => (
                    <rect
                      class={`span-${row.kind}`}
                      x={r.x * 1000}
                      width={r.w * 1000}
                      y={2}
                      height={LANE_PX - 4}
                    >
                      <title>{`${r.name}: ${(r.durUs / 1000).toFixed(3)} ms at +${(r.startUs / 1000).toFixed(3)} ms`}</title>
                    </rect>
                  ))}
                </svg>
              </div>
            ))}
            <div class="muted timeline-axis">0 — {(layout.axisUs / 1000).toFixed(2)} ms (step {data.step}, attempt {data.attempt})</div>
          </div>
        </>
      )}
    </div>
  );
}

