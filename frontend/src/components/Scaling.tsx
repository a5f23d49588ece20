// How fast would this run be on more ranks: the scaling advisor's projection of a finished run
// (GET /runs/{id}/projection, backend/advisor.py), one row per world size, with its assumptions.
import { useState } from "preact/hooks";
import { api, ApiError, ok } from "../api/client";
import type { components } from "../api/schema";
import { fmtBytes, fmtPercent, fmtSI } from "../lib/format";
import { ErrorBox, Loading, usePoll } from "./ui";

type ProjectionOut = components["schemas"]["ProjectionOut"];

const ms = (s: number) => `${(s * 1e3).toFixed(1)} ms`;

export function Scaling({ id, status }: { id: number; status: string }) {
  const [perNode, setPerNode] = useState<number | null>(null); // null: as the run was placed
  const { data, error } = usePoll(async () => {
    const query = perNode ? { ranks_per_node: perNode } : {};
    return ok(await api.GET("/api/v1/runs/{run_id}/projection", { params: { path: { run_id: id }, query } }));
  }, [id, status, perNode]);
  // 409: a run the advisor cannot project from; the reason is the answer, not a failure.
  const refused = error instanceof ApiError && error.status === 409 ? String(error.detail) : null;
  return (
    <div class="card" data-testid="scaling">
      <div class="card-head">
        <h2>Scaling</h2>
        {data ? (
          <label class="muted">
            ranks per node{" "}
            <input
              type="number"
              min={1}
              max={4096}
              value={perNode ?? data.measured.ranks_per_node}
              onChange={(e) => setPerNode(Math.max(1, Number((e.target as HTMLInputElement).value) || 1))}
              data-testid="scaling-per-node"
            />
          </label>
        ) : null}
      </div>
      {refused ? (
        <div class="state state-empty" data-testid="scaling-refused">
          {refused}
        </div>
      ) : error ? (
        <ErrorBox error={error} />
      ) : data === undefined ? (
        <Loading what="Projecting" />
      ) : (
        <Projection p={data} />
      )}
    </div>
  );
}

function Projection({ p }: { p: ProjectionOut }) {
  const m = p.measured;
  return (
    <div>
      <p>
        <strong data-testid="scaling-headline">
          {p.strategy.toUpperCase()} measured at {m.world} ranks: {fmtSI(m.samples_per_s)} samples/s ({ms(m.step_time_s)}{" "}
          a step, {ms(m.exposed_comm_s)} of it exposed comm)
        </strong>
      </p>
      <p class="muted">
        Weak scaling: every rank keeps its batch of {m.per_rank_batch}. Efficiency: the step time at one rank over the step time
        at N.
      </p>
      <table class="table" data-testid="scaling-table">
        <thead>
          <tr>
            <th class="num">Ranks</th>
            <th class="num">Nodes</th>
            <th class="num">Step</th>
            <th class="num">Exposed comm</th>
            <th class="num">Samples/s</th>
            <th>Efficiency</th>
            <th class="num">Memory/rank</th>
          </tr>
        </thead>
        <tbody>
          {p.points.map((pt) => (
            <tr data-ranks={pt.ranks} class={pt.ranks === m.world ? "slowest" : ""}>
              <td class="num">
                {pt.ranks}
                {pt.ranks === m.world ? <span class="tag">measured</span> : null}
              </td>
              <td class="num">{pt.nodes}</td>
              <td class="num">{ms(pt.step_time_s)}</td>
              <td class="num">{ms(pt.exposed_comm_s)}</td>
              <td class="num">{fmtSI(pt.samples_per_s)}</td>
              <td>
                <div class="progress" title={`${fmtPercent(pt.efficiency)} of linear scaling`}>
                  <div class="progress-bar" style={{ width: `${Math.min(100, pt.efficiency * 100)}%` }} />
                  <span class="progress-text">{fmtPercent(pt.efficiency)}</span>
                </div>
              </td>
              <td class="num">{fmtBytes(pt.peak_bytes)}</td>
            </tr>
          ))}
        </tbody>
      </table>
      <details data-testid="scaling-assumptions">
        <summary>Assumptions</summary>
        <ul>
          {p.assumptions.map((a) => (
            <li>{a}</li>
          ))}
        </ul>
      </details>
      <details>
        <summary>Not projected</summary>
        <ul>
          {Object.entries(p.excluded).map(([kind, why]) => (
            <li>
              <strong>{kind}</strong>: {why}
            </li>
          ))}
        </ul>
      </details>
    </div>
  );
}
