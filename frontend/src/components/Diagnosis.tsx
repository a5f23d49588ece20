// Why is it stuck: the run's latest hang diagnosis (its ranks' Flight Recorders and Python stacks,
// compared across ranks by the server) and, while the run runs, a Diagnose button that asks anew.
import { useState } from "preact/hooks";
import { api, ApiError, ok } from "../api/client";
import type { components } from "../api/schema";
import { fmtClock } from "../lib/format";
import { ErrorBox, usePoll } from "./ui";

type DiagnosisOut = components["schemas"]["DiagnosisOut"];
type Frame = components["schemas"]["StackFrame"];

const PENDING_POLL_MS = 1000;

async function latest(id: number): Promise<DiagnosisOut | null> {
  const result = await api.GET("/api/v1/runs/{run_id}/diagnosis", { params: { path: { run_id: id } } });
  if (result.response.status === 404) return null; // never diagnosed
  return ok(result);
}

/** The card: shown on a running run (to ask) and on any run that has a diagnosis (a stall's). */
export function Diagnosis({ id, status }: { id: number; status: string }) {
  const [asking, setAsking] = useState(false);
  const [askError, setAskError] = useState<unknown>(undefined);
  const [pending, setPending] = useState(false);
  const { data, error, reload } = usePoll(
    async () => {
      const found = await latest(id);
      setPending(found?.status === "pending");
      return found;
    },
    [id, status, pending], // a request in flight is polled until the ranks answered
    pending ? PENDING_POLL_MS : undefined,
  );
  const running = status === "running";
  if (!running && !data) return null;

  const ask = async () => {
    setAsking(true);
    setAskError(undefined);
    try {
      ok(await api.POST("/api/v1/runs/{run_id}/diagnose", { params: { path: { run_id: id } } }));
      setPending(true);
      reload();
    } catch (e) {
      setAskError(e);
    } finally {
      setAsking(false);
    }
  };

  return (
    <div class="card" data-testid="diagnosis">
      <div class="card-head">
        <h2>Hang diagnosis</h2>
        <span>
          {data && data.status !== "pending" ? (
            <a class="btn btn-small" href={`/api/v1/runs/${id}/diagnosis/dumps`} download data-testid="diagnosis-dumps">
              Download dumps
            </a>
          ) : null}{" "}
          {running ? (
            <button class="btn btn-small btn-primary" onClick={ask} disabled={asking || pending} data-testid="diagnose">
              {asking || pending ? "Asking the ranks…" : "Diagnose"}
            </button>
          ) : null}
        </span>
      </div>
      {askError ? <ErrorBox error={askError instanceof ApiError ? askError.message : askError} /> : null}
      {error ? <ErrorBox error={error} /> : null}
      {!data ? (
        <div class="state state-empty">
          Stuck? Diagnose asks every rank for its Flight Recorder (the collectives it entered) and its Python stacks,
          and names the rank the others wait for.
        </div>
      ) : (
        <Result d={data} />
      )}
    </div>
  );
}

function Result({ d }: { d: DiagnosisOut }) {
  const stuck = d.ranks.filter((r) => r.state !== "silent" && r.frames.length > 0);
  return (
    <div data-status={d.status} data-testid="diagnosis-result">
      <p>
        <strong data-testid="diagnosis-headline">{d.headline}</strong>
      </p>
      <p class="muted">
        {d.trigger === "stall" ? "Asked by the watchdog (stall)" : `Asked by ${d.requested_by || "a user"}`} at{" "}
        {fmtClock(d.requested_at)}, attempt {d.attempt}: {d.answered} of {d.world} ranks answered
        {d.status === "partial" ? " (not every node in time)" : ""}.
      </p>
      {d.findings.length > 1 ? (
        <ul data-testid="diagnosis-findings">
          {d.findings.slice(1).map((f) => (
            <li>{f.text}</li>
          ))}
        </ul>
      ) : null}
      {d.ranks.length ? (
        <table class="table" data-testid="diagnosis-ranks">
          <thead>
            <tr>
              <th class="num">Rank</th>
              <th>Where</th>
              <th class="num">Waiting</th>
            </tr>
          </thead>
          <tbody>
            {d.ranks.map((r) => (
              <tr data-rank={r.rank} data-state={r.state}>
                <td class="num">{r.rank}</td>
                <td>{r.where}</td>
                <td class="num">{r.waiting_s == null ? "—" : `${r.waiting_s.toFixed(1)} s`}</td>
              </tr>
            ))}
          </tbody>
        </table>
      ) : null}
      {d.groups.map((g) => (
        <details data-testid={`diagnosis-group-${g.group}`}>
          <summary>
            {g.label}: the last collective each rank entered and completed
          </summary>
          <table class="table">
            <thead>
              <tr>
                <th class="num">Rank</th>
                <th class="num">Entered</th>
                <th class="num">Completed</th>
                <th>Last</th>
              </tr>
            </thead>
            <tbody>
              {g.ranks.map((row) => (
                <tr>
                  <td class="num">{row.rank}</td>
                  <td class="num">{row.entered ?? "—"}</td>
                  <td class="num">{row.completed ?? "—"}</td>
                  <td>{row.last ? `${row.last.op} #${row.last.seq} ${row.last.sizes} (${row.last.state})` : "—"}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </details>
      ))}
      {stuck.map((r) => (
        <details data-testid={`diagnosis-stack-${r.rank}`}>
          <summary>
            Rank {r.rank}: innermost frames of the run's code
          </summary>
          <pre class="json">{stack(r.frames, r.innermost)}</pre>
        </details>
      ))}
    </div>
  );
}

/** The frames as a traceback reads (outermost first), with the innermost library frame last. */
function stack(frames: Frame[], innermost: Frame | null | undefined): string {
  const shown = innermost && innermost.lib ? [...frames, innermost] : frames;
  return shown.map((f) => `${f.file}:${f.line} in ${f.func}\n    ${f.code}`).join("\n");
}
