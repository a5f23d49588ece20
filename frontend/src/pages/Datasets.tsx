import { api, ok } from "../api/client";
import { Empty, ErrorBox, Loading, usePoll } from "../components/ui";
import type { components } from "../api/schema";
import { fmtAge, fmtBytes } from "../lib/format";

type Field = components["schemas"]["FieldOut"];

/** A field as its samples hold it: "input.npy <f4[8]" when every .npy agrees, else its name. */
function fieldLabel(name: string, field: Field): string {
  const npy = field.npy as { dtype?: string; shape?: number[] } | null | undefined;
  return npy?.dtype && npy.shape ? `${name} ${npy.dtype}[${npy.shape.join("×")}]` : name;
}

/** The registered datasets (`torchyard dataset create`): what a run's `data.dataset` may name. */
export function Datasets() {
  const { data, error, reload } = usePoll(async () => ok(await api.GET("/api/v1/datasets")), [], 5000);
  return (
    <section>
      <div class="page-head">
        <h1>Datasets</h1>
      </div>
      {error !== undefined && <ErrorBox error={error} retry={reload} />}
      {data === undefined && error === undefined && <Loading what="Loading datasets" />}
      {data && data.length === 0 && (
        <Empty>
          No dataset yet. Create one with <code>torchyard dataset create NAME --from DIR</code>, then name it in a
          run spec: <code>"data": {"{"}"dataset": "NAME"{"}"}</code>.
        </Empty>
      )}
      {data && data.length > 0 && (
        <table class="table" data-testid="datasets">
          <thead>
            <tr>
              <th>Name</th>
              <th>Status</th>
              <th class="num">Samples</th>
              <th class="num">Shards</th>
              <th class="num">Size</th>
              <th>Fields</th>
              <th>Created</th>
            </tr>
          </thead>
          <tbody>
            {data.map((d) => (
              <tr data-testid={`dataset-${d.name}`}>
                <td>
                  <strong>{d.name}</strong>
                  {d.digest && <div class="muted mono" title={`content sha256 ${d.digest}`}>{d.digest.slice(0, 12)}</div>}
                </td>
                <td>
                  <span class={`badge badge-${d.status === "ready" ? "succeeded" : "running"}`}>{d.status}</span>
                </td>
                <td class="num">{d.samples.toLocaleString()}</td>
                <td class="num">{d.shards}</td>
                <td class="num">{fmtBytes(d.bytes)}</td>
                <td>
                  {Object.entries(d.schema).map(([name, f]) => (
                    <span class="chip" title={`${f.samples.toLocaleString()} samples, ${fmtBytes(f.bytes)}`}>
                      {fieldLabel(name, f)}
                    </span>
                  ))}
                </td>
                <td class="muted">{fmtAge(d.created_at)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  );
}
