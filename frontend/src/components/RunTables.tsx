// The run page's tables: each rank's latest figures (the slowest marked), the state history, and
// the logs with a rank filter.
import { useEffect, useRef, useState } from "preact/hooks";
import type { LogLine, RunEvent } from "../api/client";
import { fmtClock, fmtDuration, fmtSI, fmtTs } from "../lib/format";
import { StatusBadge } from "./ui";

export interface RankRow {
  rank: number;
  step: number;
  values: Record<string, number | null>;
}

/** One row per rank; the comm column shows exposed comm where the run reports it. */
export function RankTable({ ranks, keys }: { ranks: RankRow[]; keys: string[] }) {
  const slowest = ranks.reduce<RankRow | null>(
    (m, r) => ((r.values.step_time_s ?? -1) > (m?.values.step_time_s ?? -1) ? r : m),
    null,
  );
  const commKey = keys.includes("exposed_comm_s") ? "exposed_comm_s" : keys.includes("comm_time_s") ? "comm_time_s" : null;
  return (
    <div class="card">
      <h2>Ranks</h2>
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
            </tr>
          </thead>
          <tbody>
            {ranks.map((r) => (
              <tr class={ranks.length > 1 && r === slowest ? "slowest" : ""} title={r === slowest ? "slowest rank" : ""}>
                <td>
                  {r.rank}
                  {ranks.length > 1 && r === slowest && <span class="tag">slowest</span>}
                </td>
                <td class="num">{r.step.toLocaleString("en-US")}</td>
                <td class="num">{fmtDuration(r.values.step_time_s)}</td>
                <td class="num">{commKey ? fmtDuration(r.values[commKey]) : "—"}</td>
                <td class="num">{fmtSI(r.values.samples_per_s)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </div>
  );
}

export function StateHistory({ events }: { events: RunEvent[] }) {
  return (
    <div class="card">
      <h2>State history</h2>
      <table class="table" data-testid="events">
        <tbody>
          {events.map((e) => (
            <tr>
              <td class="muted nowrap">{fmtClock(e.at)}</td>
              <td>
                <StatusBadge status={e.to_status} />
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

export function LogsCard({ lines, active }: { lines: LogLine[]; active: boolean }) {
  const [logRank, setLogRank] = useState<string>("all");
  const shown = logRank === "all" ? lines : lines.filter((l) => String(l.rank) === logRank);
  const logRanks = [...new Set(lines.map((l) => l.rank))].sort((a, b) => a - b);
  return (
    <div class="card">
      <div class="card-head">
        <h2>Logs</h2>
        <select value={logRank} onChange={(e) => setLogRank((e.target as HTMLSelectElement).value)} data-testid="log-rank">
          <option value="all">All ranks</option>
          {logRanks.map((r) => (
            <option value={String(r)}>{r === -1 ? "launcher" : `rank ${r}`}</option>
          ))}
        </select>
      </div>
      {shown.length === 0 ? (
        <div class="state state-empty">No log lines{active ? " yet" : ""}.</div>
      ) : (
        <LogView lines={shown} />
      )}
    </div>
  );
}

function LogView({ lines }: { lines: LogLine[] }) {
  const box = useRef<HTMLPreElement>(null);
  useEffect(() => {
    const el = box.current;
    if (el && el.scrollHeight - el.scrollTop - el.clientHeight < 80) el.scrollTop = el.scrollHeight;
  }, [lines]);
  return (
    <pre class="logs" ref={box} data-testid="logs">
      {lines.slice(-500).map((l) => (
        <div>
          <span class="muted">{fmtTs(l.ts)}</span> <span class="rank">[{l.rank === -1 ? "agent" : l.rank}]</span> {l.text}
        </div>
      ))}
    </pre>
  );
}
