// A new sweep from a run (#/sweeps/new?from=12, "New sweep" on the run page): the run's spec is its
// base; the parameters and their ranges, the objective and the budget are picked here. The server
// checks it all (POST /api/v1/sweeps): its 422 messages are shown by the parameter they name.
import { useEffect, useState } from "preact/hooks";
import { api, ApiError, ok } from "../api/client";
import type { components } from "../api/schema";
import { ErrorBox, Loading } from "../components/ui";
import { go, type Route } from "../lib/route";
import { type ParamRow, sortErrors, spaceOf } from "../lib/sweeps";

type Run = components["schemas"]["RunOut"];
type SweepIn = components["schemas"]["SweepSpec"];

function firstRow(run: Run): ParamRow {
  const lr = Number((run.spec.training as { lr?: number }).lr ?? 1e-3);
  const sig = (v: number) => String(Number(v.toPrecision(2)));
  return { path: "training.lr", type: "float", low: sig(lr / 10), high: sig(Math.min(1, lr * 10)), log: true, choices: "" };
}

const EMPTY_ROW: ParamRow = { path: "", type: "float", low: "", high: "", log: false, choices: "" };

export function NewSweep({ route }: { route: Route }) {
  const from = Number(route.query.get("from"));
  const [run, setRun] = useState<Run | null>(null);
  const [loadError, setLoadError] = useState<unknown>(undefined);
  const [name, setName] = useState("");
  const [rows, setRows] = useState<ParamRow[]>([]);
  const [metric, setMetric] = useState("loss");
  const [direction, setDirection] = useState<"minimize" | "maximize">("minimize");
  const [nTrials, setNTrials] = useState("10");
  const [maxConcurrent, setMaxConcurrent] = useState("2");
  const [sampler, setSampler] = useState("tpe");
  const [pruner, setPruner] = useState("asha");
  const [errors, setErrors] = useState<{ byRow: Record<number, string[]>; rest: string[] }>({ byRow: {}, rest: [] });
  const [busy, setBusy] = useState(false);

  useEffect(() => {
    if (!from) {
      setLoadError(new Error("a sweep starts from a run: open a run and pick New sweep"));
      return;
    }
    api.GET("/api/v1/runs/{run_id}", { params: { path: { run_id: from } } }).then(
      (r) => {
        const got = ok(r);
        setRun(got);
        setName(`${got.name} sweep`);
        setRows([firstRow(got)]);
      },
      (e) => setLoadError(e),
    );
  }, [from]);

  if (loadError !== undefined) return <ErrorBox error={loadError} />;
  if (!run) return <Loading what="Loading the run to sweep from" />;

  const setRow = (i: number, change: Partial<ParamRow>) => {
    setRows((rs) => rs.map((r, j) => (j === i ? { ...r, ...change } : r)));
    setErrors((e) => ({ ...e, byRow: { ...e.byRow, [i]: [] } }));
  };
  const submit = async (e: Event) => {
    e.preventDefault();
    setBusy(true);
    setErrors({ byRow: {}, rest: [] });
    const body = {
      name: name.trim() || null,
      base: { ...run.spec, name: run.name },
      space: spaceOf(rows),
      objective: { metric: metric.trim(), direction },
      n_trials: Number(nTrials),
      max_concurrent: Number(maxConcurrent),
      sampler,
      pruner: { kind: pruner },
    };
    try {
      const sweep = ok(await api.POST("/api/v1/sweeps", { body: body as unknown as SweepIn }));
      go(`#/sweeps/${sweep.id}`);
    } catch (err) {
      if (err instanceof ApiError && err.status === 422 && err.fieldErrors.length) setErrors(sortErrors(err.fieldErrors, rows));
      else setErrors({ byRow: {}, rest: [err instanceof Error ? err.message : String(err)] });
    } finally {
      setBusy(false);
    }
  };

  return (
    <section>
      <div class="page-head">
        <h1>New sweep</h1>
        <span class="muted">
          from <a href={`#/runs/${run.id}`}>run {run.id} {run.name}</a>: its spec is every trial's base
        </span>
      </div>
      <form class="card spec-form" onSubmit={submit} noValidate data-testid="new-sweep-form">
        <div class="grid">
          <label class="field">
            <span>Name</span>
            <input name="name" value={name} onInput={(e) => setName((e.target as HTMLInputElement).value)} />
          </label>
          <label class="field">
            <span>Objective metric</span>
            <input name="metric" value={metric} onInput={(e) => setMetric((e.target as HTMLInputElement).value)} />
          </label>
          <label class="field">
            <span>Direction</span>
            <select name="direction" value={direction} onChange={(e) => setDirection((e.target as HTMLSelectElement).value as "minimize")}>
              <option value="minimize">minimize</option>
              <option value="maximize">maximize</option>
            </select>
          </label>
          <label class="field">
            <span>Trials</span>
            <input name="n_trials" type="number" min={1} value={nTrials} onInput={(e) => setNTrials((e.target as HTMLInputElement).value)} />
          </label>
          <label class="field">
            <span>At once, at most</span>
            <input
              name="max_concurrent"
              type="number"
              min={1}
              value={maxConcurrent}
              onInput={(e) => setMaxConcurrent((e.target as HTMLInputElement).value)}
            />
          </label>
          <label class="field">
            <span>Sampler</span>
            <select name="sampler" value={sampler} onChange={(e) => setSampler((e.target as HTMLSelectElement).value)}>
              {["tpe", "random", "grid", "cmaes"].map((s) => (
                <option value={s}>{s}</option>
              ))}
            </select>
          </label>
          <label class="field">
            <span>Pruner</span>
            <select name="pruner" value={pruner} onChange={(e) => setPruner((e.target as HTMLSelectElement).value)}>
              {["asha", "median", "none"].map((s) => (
                <option value={s}>{s}</option>
              ))}
            </select>
          </label>
        </div>
        <h2>Parameters</h2>
        <table class="table sweep-params" data-testid="sweep-params">
          <thead>
            <tr>
              <th>Spec path</th>
              <th>Type</th>
              <th>Low</th>
              <th>High</th>
              <th>Log</th>
              <th>Choices (comma-separated)</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {rows.map((r, i) => {
              const cat = r.type === "categorical";
              const rowErrors = errors.byRow[i] ?? [];
              const input = (key: "path" | "low" | "high" | "choices", disabled = false) => (
                <input
                  name={`param-${i}-${key}`}
                  value={r[key]}
                  disabled={disabled}
                  onInput={(e) => setRow(i, { [key]: (e.target as HTMLInputElement).value })}
                />
              );
              return (
                <>
                  <tr class={rowErrors.length ? "has-error" : ""} data-testid={`param-${i}`}>
                    <td>{input("path")}</td>
                    <td>
                      <select
                        name={`param-${i}-type`}
                        value={r.type}
                        onChange={(e) => setRow(i, { type: (e.target as HTMLSelectElement).value as ParamRow["type"] })}
                      >
                        <option value="float">float</option>
                        <option value="int">int</option>
                        <option value="categorical">categorical</option>
                      </select>
                    </td>
                    <td>{input("low", cat)}</td>
                    <td>{input("high", cat)}</td>
                    <td>
                      <input
                        type="checkbox"
                        name={`param-${i}-log`}
                        checked={r.log}
                        disabled={cat}
                        onChange={(e) => setRow(i, { log: (e.target as HTMLInputElement).checked })}
                      />
                    </td>
                    <td>{input("choices", !cat)}</td>
                    <td>
                      <button type="button" class="btn btn-small btn-ghost" onClick={() => setRows((rs) => rs.filter((_, j) => j !== i))}>
                        Remove
                      </button>
                    </td>
                  </tr>
                  {rowErrors.length > 0 && (
                    <tr>
                      <td colSpan={7} class="field-error" data-testid={`param-error-${i}`}>
                        {r.path}: {rowErrors.join("; ")}
                      </td>
                    </tr>
                  )}
                </>
              );
            })}
          </tbody>
        </table>
        <button type="button" class="btn btn-small" onClick={() => setRows((rs) => [...rs, { ...EMPTY_ROW }])} data-testid="add-param">
          Add a parameter
        </button>
        {errors.rest.length > 0 && (
          <div class="form-error" role="alert" data-testid="sweep-form-error">
            {errors.rest.join("; ")}
          </div>
        )}
        <div class="form-actions">
          <button class="btn btn-primary" type="submit" disabled={busy} data-testid="submit-sweep">
            {busy ? "Submitting…" : "Start sweep"}
          </button>
          <a class="btn btn-ghost" href={`#/runs/${run.id}`}>
            Cancel
          </a>
        </div>
      </form>
    </section>
  );
}
