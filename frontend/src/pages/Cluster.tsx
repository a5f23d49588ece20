import { api, ok } from "../api/client";
import { Empty, ErrorBox, Loading, usePoll } from "../components/ui";
import { fmtAge } from "../lib/format";

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
              <th>Slots (used / total)</th>
              <th>Heartbeat</th>
              <th>Runs</th>
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
                </tr>
              );
            })}
          </tbody>
        </table>
      )}
    </section>
  );
}
