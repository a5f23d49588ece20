import { api, ok } from "../api/client";
import { Empty, ErrorBox, Loading, usePoll } from "../components/ui";
import type { components } from "../api/schema";
import { fmtAge, fmtBytes } from "../lib/format";

type Gpu = components["schemas"]["GpuOut"];
type Pool = components["schemas"]["PoolOut"];

/** A Slurm pool: its partitions and nodes as sinfo says now, and the runs it holds (job ids). */
function SlurmPool({ pool }: { pool: Pool }) {
  const partitions = Object.entries(pool.partitions ?? {});
  return (
    <div class="card" data-testid={`pool-${pool.name}`}>
      <h2>
        Slurm pool {pool.name}
        {pool.default ? <span class="muted"> (default)</span> : null}
      </h2>
      {pool.error ? <div class="error">Slurm did not answer: {pool.error}</div> : null}
      <p class="muted">
        Partitions:{" "}
        {partitions.length
          ? partitions.map(([name, count]) => (
              <span class="chip">
                {name}
                {name === pool.default_partition ? "*" : ""} · {count} node{count === 1 ? "" : "s"}
              </span>
            ))
          : "none"}
        {pool.partition ? <> · runs go to {pool.partition}</> : null}
        {pool.account ? <> · account {pool.account}</> : null}
      </p>
      {(pool.nodes ?? []).length > 0 && (
        <table class="table" data-testid="slurm-nodes">
          <thead>
            <tr>
              <th>Node</th>
              <th>Partition</th>
              <th>State</th>
              <th>CPUs</th>
              <th>GPUs (GRES)</th>
            </tr>
          </thead>
          <tbody>
            {(pool.nodes ?? []).map((n) => (
              <tr>
                <td>
                  <strong>{n.name}</strong>
                </td>
                <td>{n.partition}</td>
                <td>
                  <span class={`badge badge-${/down|drain|fail/.test(n.state) ? "failed" : n.state === "idle" ? "succeeded" : "running"}`}>{n.state}</span>
                </td>
                <td>{n.cpus}</td>
                <td class="mono">{n.gres === "(null)" ? "none" : n.gres}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      <p>
        Runs:{" "}
        {(pool.jobs ?? []).length
          ? (pool.jobs ?? []).map((j) => (
              <a href={`#/runs/${j.run_id}`} class="chip" title={`attempt ${j.attempt}, ${j.status}`}>
                #{j.run_id} · job {j.job_id || "submitting"}
              </a>
            ))
          : <span class="muted">none</span>}
      </p>
    </div>
  );
}

function SlurmPools() {
  const { data } = usePoll(async () => ok(await api.GET("/api/v1/pools")), [], 5000);
  const slurm = (data ?? []).filter((p) => p.executor === "slurm");
  return (
    <>
      {slurm.map((p) => (
        <SlurmPool pool={p} />
      ))}
    </>
  );
}

/** One chip per GPU: its index, model and memory, and the run holding it (free ones pale). */
function Gpus({ gpus, free }: { gpus: Gpu[]; free: number }) {
  if (!gpus.length) return <span class="muted">none</span>;
  return (
    <div data-testid="gpus">
      <div class="muted">
        {gpus.length - free} / {gpus.length} used ({free} free)
      </div>
      {gpus.map((g) => {
        const about = [g.name, g.memory_bytes != null ? fmtBytes(g.memory_bytes) : ""].filter(Boolean).join(", ");
        return (
          <span class={`chip gpu-chip ${g.run_id == null ? "gpu-free" : ""}`} title={about || "model not known (TORCHYARD_NODE_GPUS)"}>
            GPU {g.index}
            {g.run_id != null ? (
              <>
                {" · "}
                <a href={`#/runs/${g.run_id}`}>#{g.run_id}</a>
              </>
            ) : (
              " · free"
            )}
          </span>
        );
      })}
    </div>
  );
}

export function Cluster() {
  const { data, error, reload } = usePoll(async () => ok(await api.GET("/api/v1/nodes")), [], 2000);
  return (
    <section>
      <div class="page-head">
        <h1>Cluster</h1>
      </div>
      {error !== undefined && <ErrorBox error={error} retry={reload} />}
      {data === undefined && error === undefined && <Loading what="Loading nodes" />}
      {data && data.length === 0 && <Empty>No worker has registered. Start one with <code>torchyard worker</code>.</Empty>}
      {data && data.length > 0 && (
        <table class="table" data-testid="nodes">
          <thead>
            <tr>
              <th>Node</th>
              <th>Host</th>
              <th>Status</th>
              <th>Devices</th>
              <th>CPU slots (used / total)</th>
              <th>GPUs</th>
              <th>Heartbeat</th>
              <th>Runs</th>
              <th>Caps</th>
            </tr>
          </thead>
          <tbody>
            {data.map((n) => {
              const used = n.status === "alive" ? n.slots - n.free_slots : 0;
              return (
                <tr>
                  <td>
                    <strong>{n.id}</strong>
                  </td>
                  <td class="mono">{n.host}</td>
                  <td>
                    <span class={`badge badge-${n.status === "alive" ? "running" : "failed"}`}>{n.status}</span>
                  </td>
                  <td>{n.devices.join(", ")}</td>
                  <td class="progress-cell">
                    <div class="progress" title={`${n.free_slots} free`}>
                      <div class="progress-bar" style={{ width: `${n.slots ? (100 * used) / n.slots : 0}%` }} />
                      <span class="progress-text">
                        {used} / {n.slots} ({n.free_slots} free)
                      </span>
                    </div>
                  </td>
                  <td>
                    <Gpus gpus={n.gpus} free={n.free_gpus} />
                  </td>
                  <td class="muted">{fmtAge(n.last_heartbeat)}</td>
                  <td>
                    {n.running_runs.length
                      ? n.running_runs.map((id) => (
                          <a href={`#/runs/${id}`} class="chip">
                            #{id}
                          </a>
                        ))
                      : <span class="muted">idle</span>}
                  </td>
                  <td class={n.caps.includes("not capped") ? "warning" : "muted"} data-testid="node-caps">
                    {n.caps || "not reported"}
                  </td>
                </tr>
              );
            })}
          </tbody>
        </table>
      )}
      <SlurmPools />
    </section>
  );
}
