// The run page's head: name, status and why, the spec in one line, its actions (cancel, clone)
// and its progress, duration, attempts and nodes.
import { useState } from "preact/hooks";
import { api, ok, type Run, type StrategyComparison } from "../api/client";
import { fmtDuration, fmtNumber, fmtPercent, fmtSI } from "../lib/format";
import { TERMINAL } from "../lib/states";
import { duration, summary } from "../pages/Runs";
import type { ComponentChildren } from "preact";
import { ErrorBox, Progress, StatusBadge } from "./ui";

function specSummary(run: Run): string {
  const { workload, resources, training } = run.spec;
  const s = summary(run);
  const where = `${s.shape} on ${resources?.device ?? "cpu"}`;
  if (workload.kind === "script") {
    // its own loop decides strategy, batch and lr: show only what the platform runs
    return [`script ${workload.entry} ${(workload.args ?? []).join(" ")}`.trim(), where].join(" · ");
  }
  const params = Object.entries(workload.params ?? {})
    .map(([k, v]) => `${k}=${String(v)}`)
    .join(" ");
  return [
    `${workload.name}${params ? ` (${params})` : ""}`,
    s.strategy,
    where,
    `${(training?.steps ?? 0).toLocaleString("en-US")} steps`,
    `batch ${training?.batch_size ?? "?"}`,
    `lr ${training?.lr ?? "?"}`,
  ].join(" · ");
}

/** ``onChange`` reads the run again (after a cancel). */
export function RunHead({ run, onChange }: { run: Run; onChange: () => Promise<unknown> }) {
  const [cancelling, setCancelling] = useState(false);
  const [actionError, setActionError] = useState<string | null>(null);
  const id = run.id;
  const s = summary(run);
  const active = !TERMINAL.has(run.status);
  const fig = run.summary;
  const [compared, setCompared] = useState<StrategyComparison | null>(null);
  const [comparing, setComparing] = useState(false);
  const compare = async () => {
    setComparing(true);
    setActionError(null);
    try {
      setCompared(ok(await api.POST("/api/v1/runs/{run_id}/strategy-comparison", { params: { path: { run_id: id } } })));
    } catch (e) {
      setActionError(e instanceof Error ? e.message : String(e));
    } finally {
      setComparing(false);
    }
  };
  const cancel = async () => {
    setCancelling(true);
    setActionError(null);
    try {
      ok(await api.POST("/api/v1/runs/{run_id}/cancel", { params: { path: { run_id: id } } }));
      await onChange();
    } catch (e) {
      setActionError(e instanceof Error ? e.message : String(e));
    } finally {
      setCancelling(false);
    }
  };

  return (
    <>
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
            {run.warnings.map((w) => (
              <div class="warning" data-testid="run-warning">
                At submit: {w}
              </div>
            ))}
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
            <a
              class="btn"
              href={`#/sweeps/new?from=${run.id}`}
              data-testid="new-sweep"
              title="a hyperparameter sweep with this run's spec as every trial's base"
            >
              New sweep
            </a>
            {run.spec.workload.kind !== "script" && (
              <button
                class="btn"
                onClick={compare}
                disabled={comparing}
                data-testid="compare-strategies"
                title="queue this workload once per strategy that applies (same data, resources and training), to compare them"
              >
                {comparing ? "Queueing…" : "Compare strategies"}
              </button>
            )}
          </div>
        </div>
        {actionError && <ErrorBox error={actionError} />}
        {compared && (
          <div class="card" data-testid="strategy-comparison">
            Queued {compared.runs.length} runs, one per strategy:{" "}
            {compared.runs.map((r) => (
              <a href={`#/runs/${r.id}`}>
                #{r.id} {r.spec.strategy?.kind}{" "}
              </a>
            ))}
            <a class="btn btn-primary btn-small" href={`#/compare?ids=${compared.runs.map((r) => r.id).join(",")}`} data-testid="open-comparison">
              Compare them
            </a>
            {compared.skipped.map((s) => (
              <div class="muted">
                Not {s.strategy}: {s.reason}
              </div>
            ))}
          </div>
        )}

        <div class="stats" data-testid="run-summary">
          <div class="stat stat-wide">
            <span>Progress</span>
            <Progress value={run.last_step} total={s.steps} />
          </div>
          <Stat label="Final loss" testId="final-loss" title={fig?.final_loss_step ? `the mean over ranks at step ${fig.final_loss_step}` : undefined}>
            {fmtNumber(fig?.final_loss, 4)}
          </Stat>
          <Stat label="Best loss" testId="best-loss" title="the lowest mean over ranks of a step">
            {fmtNumber(fig?.best_loss, 4)}
          </Stat>
          <Stat label="Samples/s (mean)" testId="mean-throughput" title="global batch / mean step time, over the run">
            {fmtSI(fig?.mean_samples_per_s)}
          </Stat>
          <Stat label="Comm fraction (mean)" testId="mean-comm" title="exposed comm / step time, mean over ranks and steps">
            {fmtPercent(fig?.mean_comm_fraction)}
          </Stat>
          <Stat label="Wall time" testId="wall-time">
            {fmtDuration(fig?.wall_time_s ?? duration(run))}
          </Stat>
          <Stat label="Attempts">{run.attempt_count}</Stat>
          <Stat label="Nodes">{run.node_ids.join(", ") || "—"}</Stat>
        </div>
        {run.spec.workload.kind === "script" && run.last_step > 0 && fig && fig.final_loss == null && (
          <div class="muted" data-testid="no-loss-hint">
            No loss: this script called <code>backward()</code> on no one-element tensor, where torchyard takes it
            from. Chart your own with one line after each step: <code>torchyard.log(step, loss=loss.item())</code>{" "}
            (<code>import torchyard</code>; it is importable in every run).
          </div>
        )}
    </>
  );
}

function Stat({ label, title, testId, children }: { label: string; title?: string; testId?: string; children: ComponentChildren }) {
  return (
    <div class="stat" title={title}>
      <span>{label}</span>
      <strong data-testid={testId}>{children}</strong>
    </div>
  );
}
