// The run page's tables: each rank's latest figures (the stragglers marked) and the state history
// (with the live alerts).
import type { IngestedEvent, RunEvent } from "../api/client";
import { fmtClock, fmtDuration, fmtSI } from "../lib/format";
import { StatusBadge } from "./ui";

export interface RankRow {
  rank: number;
  step: number;
  values: Record<string, number | null>;
}

/** One row per rank; the comm column shows exposed comm where the run reports it. ``stored``: ingest's
 * latest word while the run is live (how far behind storage is; points a rank's SDK dropped).
 * ``stragglers``: the ranks the Stragglers card names (its attribution, the one judgement of who
 * keeps the others waiting): marked here too, never a rank of its own choosing (in a synchronous
 * run every rank's step takes as long as the slowest's, so the largest step time is noise). */
export function RankTable({
  ranks,
  keys,
  stored,
  stragglers = [],
}: {
  ranks: RankRow[];
  keys: string[];
  stored?: IngestedEvent | null;
  stragglers?: number[];
}) {
  const commKey = keys.includes("exposed_comm_s") ? "exposed_comm_s" : keys.includes("comm_time_s") ? "comm_time_s" : null;
  const dropped = stored?.sdk_dropped ?? {};
  const anyDropped = Object.values(dropped).some((n) => n > 0);
  return (
    <div class="card">
      <div class="card-head">
        <h2>Ranks</h2>
        {stored && (
          <span
            class={stored.lag_s > 5 ? "tag" : "muted"}
            data-testid="ingest-lag"
            title="how far behind the ranks the stored figures are (ingest's lag): the live charts do not wait for it"
          >
            stored {fmtDuration(stored.lag_s)} behind
          </span>
        )}
      </div>
      {ranks.length === 0 ? (
        <div class="state state-empty">No rank has reported yet.</div>
      ) : (
        <table class="table" data-testid="rank-table">
          <thead>
            <tr>
              <th>Rank</th>
              <th class="num">Step</th>
              <th class="num">Step time</th>
              <th class="num">{commKey === "exposed_comm_s" ? "Exposed comm" : "Comm time"}</th>
              <th class="num">Samples/s</th>
              {anyDropped && <th class="num" title="points the rank's SDK dropped (oldest first) while Redis could not keep up">Dropped</th>}
            </tr>
          </thead>
          <tbody>
            {ranks.map((r) => (
              <tr
                class={stragglers.includes(r.rank) ? "slowest" : ""}
                title={stragglers.includes(r.rank) ? "a straggler: the others wait for it (see Stragglers)" : ""}
                data-rank={r.rank}
              >
                <td>
                  {r.rank}
                  {stragglers.includes(r.rank) && <span class="tag">straggler</span>}
                </td>
                <td class="num">{r.step.toLocaleString("en-US")}</td>
                <td class="num">{fmtDuration(r.values.step_time_s)}</td>
                <td class="num">{commKey ? fmtDuration(r.values[commKey]) : "—"}</td>
                <td class="num">{fmtSI(r.values.samples_per_s)}</td>
                {anyDropped && (
                  <td class="num" data-testid={`sdk-dropped-${r.rank}`}>
                    {(dropped[String(r.rank)] ?? 0).toLocaleString("en-US")}
                  </td>
                )}
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </div>
  );
}

// An alert (backend/alerts.py) is an event in the history, the run's state unchanged.
const ALERT_LABEL: Record<string, string> = { throughput: "slower", comm_fraction: "comm wait", stall: "stalled" };

export function StateHistory({ events }: { events: RunEvent[] }) {
  return (
    <div class="card">
      <h2>State history</h2>
      <table class="table" data-testid="events">
        <tbody>
          {events.map((e) => (
            <tr data-alert={e.alert ?? undefined}>
              <td class="muted nowrap">{fmtClock(e.at)}</td>
              <td>
                {e.alert ? (
                  <span class="badge badge-alert" title={`alert: ${e.alert}`}>
                    {ALERT_LABEL[e.alert] ?? e.alert}
                  </span>
                ) : (
                  <StatusBadge status={e.to_status} />
                )}
              </td>
              <td class="reason-cell">
                <pre>{e.reason}</pre>
              </td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}
