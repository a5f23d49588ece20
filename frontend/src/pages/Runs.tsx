import { useEffect, useMemo, useState } from "preact/hooks";
import { api, ok, type Run } from "../api/client";
import { Empty, ErrorBox, Loading, Progress, StatusBadge, usePoll } from "../components/ui";
import { fmtAge, fmtDuration, fmtPercent, fmtSI, parseTime } from "../lib/format";
import { go } from "../lib/route";
import { RUN_STATES } from "../lib/states";

const PAGE = 20;

type SortKey = "id" | "name" | "status" | "progress" | "throughput" | "comm" | "age" | "duration";

export interface RunSummary {
  steps: number | null;
  strategy: string;
  shape: string;
  world: number;
}

/** What the list, the run page and compare show of a run's spec. A script does its own
 * parallelism and training loop: no strategy, and its steps are unknown (null) until it logs them. */
export function summary(run: Run): RunSummary {
  const { workload, strategy, resources, training } = run.spec;
  const nodes = resources?.nodes ?? 1;
  const procs = resources?.procs_per_node ?? 1;
  const script = workload.kind === "script";
  return {
    steps: script ? null : (training?.steps ?? 0),
    strategy: script ? "script" : (strategy?.kind ?? "ddp"),
    shape: `${nodes} × ${procs}`,
    world: nodes * procs,
  };
}

export function duration(run: Run, now = Date.now()): number | null {
  const start = parseTime(run.started_at);
  if (start === null) return null;
  const end = parseTime(run.ended_at) ?? now;
  return (end - start) / 1000;
}

function sortValue(run: Run, key: SortKey): number | string {
  switch (key) {
    case "name":
      return run.name.toLowerCase();
    case "status":
      return run.status;
    case "progress":
      return run.last_step / Math.max(1, summary(run).steps ?? run.last_step);
    case "throughput":
      return run.samples_per_s ?? -1;
    case "comm":
      return run.comm_fraction ?? -1;
    case "age":
      return -(parseTime(run.created_at) ?? 0);
    case "duration":
      return duration(run) ?? -1;
    default:
      return run.id;
  }
}

export function Runs() {
  const [status, setStatus] = useState("");
  const [text, setText] = useState("");
  const [query, setQuery] = useState("");
  const [offset, setOffset] = useState(0);
  const [sort, setSort] = useState<{ key: SortKey; desc: boolean }>({ key: "id", desc: true });
  const [picked, setPicked] = useState<number[]>([]);

  useEffect(() => {
    const t = window.setTimeout(() => {
      setQuery(text);
      setOffset(0);
    }, 250);
    return () => window.clearTimeout(t);
  }, [text]);

  const { data, error, reload } = usePoll(
    async () => {
      const q: { limit: number; offset: number; status?: string; name?: string } = { limit: PAGE, offset };
      if (status) q.status = status;
      if (query) q.name = query;
      return ok(await api.GET("/api/v1/runs", { params: { query: q } }));
    },
    [status, query, offset],
    2000, // rows update live
  );

  const rows = useMemo(() => {
    const items = [...(data?.items ?? [])];
    items.sort((a, b) => {
      const va = sortValue(a, sort.key);
      const vb = sortValue(b, sort.key);
      const c = va < vb ? -1 : va > vb ? 1 : 0;
      return sort.desc ? -c : c;
    });
    return items;
  }, [data, sort]);

  const th = (key: SortKey, label: string, cls = "") => (
    <th
      class={`sortable ${cls} ${sort.key === key ? "sorted" : ""}`}
      onClick={() => setSort({ key, desc: sort.key === key ? !sort.desc : key !== "name" })}
    >
      {label}
      {sort.key === key ? (sort.desc ? " ▾" : " ▴") : ""}
    </th>
  );
  const toggle = (id: number) =>
    setPicked((p) => (p.includes(id) ? p.filter((x) => x !== id) : p.length < 6 ? [...p, id] : p));

  return (
    <section>
      <div class="page-head">
        <h1>Runs</h1>
        <div class="actions">
          <button
            class="btn"
            disabled={picked.length < 2}
            onClick={() => go(`#/compare?ids=${picked.join(",")}`)}
            data-testid="compare-picked"
          >
            Compare {picked.length ? `(${picked.length})` : ""}
          </button>
          <a class="btn btn-primary" href="#/new">
            New run
          </a>
        </div>
      </div>
      <div class="filters">
        <input
          type="search"
          placeholder="Filter by name…"
          value={text}
          onInput={(e) => setText((e.target as HTMLInputElement).value)}
          data-testid="filter-text"
        />
        <select
          value={status}
          onChange={(e) => {
            setStatus((e.target as HTMLSelectElement).value);
            setOffset(0);
          }}
          data-testid="filter-status"
        >
          <option value="">All states</option>
          <option value="queued,scheduled,running,restarting,cancelling">Active</option>
          {RUN_STATES.map((s) => (
            <option value={s}>{s}</option>
          ))}
        </select>
      </div>
      {error !== undefined && <ErrorBox error={error} retry={reload} />}
      {data === undefined && error === undefined && <Loading what="Loading runs" />}
      {data && data.total === 0 && (
        <Empty>
          {status || query ? (
            "No run matches these filters."
          ) : (
            <>
              No runs yet. <a href="#/new">Submit the first one</a>.
            </>
          )}
        </Empty>
      )}
      {data && data.total > 0 && (
        <>
          <table class="table runs-table" data-testid="runs-table">
            <thead>
              <tr>
                <th class="narrow" />
                {th("id", "#", "num")}
                {th("name", "Name")}
                {th("status", "Status")}
                <th>Strategy</th>
                <th>Nodes × procs</th>
                {th("progress", "Progress")}
                {th("throughput", "Samples/s", "num")}
                {th("comm", "Comm", "num")}
                {th("age", "Age")}
                {th("duration", "Duration")}
              </tr>
            </thead>
            <tbody>
              {rows.map((run) => {
                const s = summary(run);
                return (
                  <tr key={run.id} class="clickable" onClick={() => go(`#/runs/${run.id}`)} data-testid={`run-row-${run.id}`}>
                    <td class="narrow" onClick={(e) => e.stopPropagation()}>
                      <input
                        type="checkbox"
                        checked={picked.includes(run.id)}
                        onChange={() => toggle(run.id)}
                        aria-label={`pick run ${run.id} to compare`}
                      />
                    </td>
                    <td class="num muted">{run.id}</td>
                    <td>
                      <a href={`#/runs/${run.id}`} class="run-name">
                        {run.name}
                      </a>
                    </td>
                    <td>
                      <StatusBadge status={run.status} />
                    </td>
                    <td>{s.strategy}</td>
                    <td>{s.shape}</td>
                    <td class="progress-cell">
                      <Progress value={run.last_step} total={s.steps} />
                    </td>
                    <td class="num" data-testid="throughput" title="global batch / the slowest rank's step time, at the last step">
                      {fmtSI(run.samples_per_s)}
                    </td>
                    <td class="num">{fmtPercent(run.comm_fraction)}</td>
                    <td class="muted">{fmtAge(run.created_at)}</td>
                    <td>{fmtDuration(duration(run))}</td>
                  </tr>
                );
              })}
            </tbody>
          </table>
          <div class="pager">
            <span class="muted">
              {offset + 1}–{Math.min(offset + PAGE, data.total)} of {data.total}
            </span>
            <button class="btn btn-small" disabled={offset === 0} onClick={() => setOffset(Math.max(0, offset - PAGE))}>
              Previous
            </button>
            <button class="btn btn-small" disabled={offset + PAGE >= data.total} onClick={() => setOffset(offset + PAGE)}>
              Next
            </button>
          </div>
        </>
      )}
    </section>
  );
}
