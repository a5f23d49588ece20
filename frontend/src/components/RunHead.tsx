// The run page's head: name, status and why, the spec in one line, its actions (cancel, clone)
// and its progress, duration, attempts and nodes.
import { useState } from "preact/hooks";
import { api, ok, type Run } from "../api/client";
import { fmtDuration } from "../lib/format";
import { TERMINAL } from "../lib/stream";
import { duration, summary } from "../pages/Runs";
import { ErrorBox, Progress, StatusBadge } from "./ui";

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

/** ``onChange`` reads the run again (after a cancel). */
export function RunHead({ run, onChange }: { run: Run; onChange: () => Promise<unknown> }) {
  const [cancelling, setCancelling] = useState(false);
  const [actionError, setActionError] = useState<string | null>(null);
  const id = run.id;
  const s = summary(run);
  const active = !TERMINAL.has(run.status);
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
    </>
  );
}
