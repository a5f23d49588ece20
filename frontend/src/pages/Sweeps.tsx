import { api, ok } from "../api/client";
import type { components } from "../api/schema";
import { Empty, ErrorBox, Loading, StatusBadge, usePoll } from "../components/ui";
import { fmtAge, fmtNumber } from "../lib/format";
import { BestSoFar, Importance, ParallelCoords } from "../components/SweepCharts";
import { bestSoFar, fmtParams, trialBadge } from "../lib/sweeps";

type Sweep = components["schemas"]["SweepOut"];

/** Every sweep (`torchyard sweep create FILE`), newest first. */
export function Sweeps() {
  const { data, error, reload } = usePoll(async () => ok(await api.GET("/api/v1/sweeps")), [], 5000);
  return (
    <section>
      <div class="page-head">
        <h1>Sweeps</h1>
      </div>
      {error !== undefined && <ErrorBox error={error} retry={reload} />}
      {data === undefined && error === undefined && <Loading what="Loading sweeps" />}
      {data && data.items.length === 0 && (
        <Empty>
          No sweep yet. Start one with <code>torchyard sweep create FILE</code>: a base run spec, a search space
          over its paths, an objective.
        </Empty>
      )}
      {data && data.items.length > 0 && (
        <table class="table" data-testid="sweeps">
          <thead>
            <tr>
              <th>Sweep</th>
              <th>Status</th>
              <th class="num">Trials</th>
              <th>Best</th>
              <th>Created</th>
            </tr>
          </thead>
          <tbody>
            {data.items.map((s) => (
              <tr data-testid={`sweep-${s.id}`}>
                <td>
                  <a href={`#/sweeps/${s.id}`}>
                    #{s.id} {s.name}
                  </a>
                </td>
                <td>
                  <StatusBadge status={s.status} />
                </td>
                <td class="num">
                  {s.trials.length} / {s.spec.n_trials}
                </td>
                <td>
                  {s.best_trial === null || s.best_trial === undefined
                    ? "—"
                    : `trial ${s.best_trial}: ${s.spec.objective?.metric ?? "loss"} ${fmtNumber(s.best_value)}`}
                </td>
                <td class="muted">{fmtAge(s.created_at)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  );
}

/** One sweep: the best so far, its parameters against the objective and their importance, its
 * trials with their parameters, objective, state and run; live while it runs. */
export function SweepDetail({ id }: { id: number }) {
  const { data, error, reload } = usePoll(
    async () => ok(await api.GET("/api/v1/sweeps/{sweep_id}", { params: { path: { sweep_id: id } } })),
    [id],
    3000,
  );
  if (error !== undefined && !data) return <ErrorBox error={error} retry={reload} />;
  if (!data) return <Loading what="Loading the sweep" />;
  return <SweepView sweep={data} />;
}

function SweepView({ sweep }: { sweep: Sweep }) {
  const objective = sweep.spec.objective ?? { metric: "loss", direction: "minimize" };
  const direction = objective.direction === "maximize" ? "maximize" : "minimize";
  const trials = [...sweep.trials].sort((a, b) => a.number - b.number);
  const best = bestSoFar(trials, direction);
  const cancel = async () => {
    ok(await api.POST("/api/v1/sweeps/{sweep_id}/cancel", { params: { path: { sweep_id: sweep.id } } }));
  };
  return (
    <section>
      <div class="page-head">
        <h1>
          Sweep #{sweep.id} {sweep.name}
        </h1>
        <StatusBadge status={sweep.status} />
        {sweep.status === "running" && (
          <button class="btn btn-small" onClick={cancel} data-testid="cancel-sweep">
            Cancel sweep
          </button>
        )}
      </div>
      <p class="muted" data-testid="sweep-reason">
        {sweep.status_reason} · {direction} {objective.metric} · {sweep.spec.sampler ?? "tpe"} sampler,{" "}
        {sweep.spec.pruner?.kind ?? "asha"} pruner · {sweep.spec.max_concurrent ?? 1} at once
      </p>
      <BestSoFar trials={trials} metric={objective.metric ?? "loss"} direction={direction} />
      <ParallelCoords sweep={sweep} direction={direction} />
      <Importance id={sweep.id} complete={trials.filter((t) => t.state === "complete").length} />
      <table class="table" data-testid="trials">
        <thead>
          <tr>
            <th class="num">#</th>
            <th>State</th>
            <th>Parameters</th>
            <th class="num">{objective.metric}</th>
            <th class="num">Best so far</th>
            <th class="num">Step</th>
            <th>Run</th>
            <th>Why</th>
          </tr>
        </thead>
        <tbody>
          {trials.map((t, i) => (
            <tr data-testid={`trial-${t.number}`}>
              <td class="num">{t.number}</td>
              <td>
                <span class={`badge badge-${trialBadge(t.state)}`}>{t.state}</span>
                {t.pruned_at != null && (
                  <span class="muted" data-testid={`pruned-at-${t.number}`}>
                    {" "}
                    at step {t.pruned_at}
                  </span>
                )}
              </td>
              <td class="mono">{fmtParams(t.params)}</td>
              <td class="num">{fmtNumber(t.value)}</td>
              <td class="num">{fmtNumber(best[i])}</td>
              <td class="num">{t.pruned_at ?? t.reported_step}</td>
              <td>{t.run_id === null || t.run_id === undefined ? "—" : <a href={`#/runs/${t.run_id}`}>run {t.run_id}</a>}</td>
              <td class="muted">{t.reason}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </section>
  );
}
