import type { ComponentChildren } from "preact";
import { useEffect, useMemo, useState } from "preact/hooks";
import { api, ApiError, ok, type RunSpecIn } from "../api/client";
import { ErrorBox, Loading } from "../components/ui";
import { applies, defaultName, FORM_DEFAULTS, helpFor, inFormOrder, labelFor, MAIN, submitted } from "../lib/formlayout";
import { go, type Route } from "../lib/route";
import {
  crossChecks,
  defaults,
  fieldForError,
  nullable,
  resolve,
  RUN_SPEC,
  validate,
  variants,
  type Json,
  type JsonSchema,
  type Obj,
} from "../lib/specform";

function setPath(obj: Obj, path: string[], value: Json): Obj {
  const [head, ...rest] = path;
  if (head === undefined) return obj;
  if (!rest.length) return { ...obj, [head]: value };
  return { ...obj, [head]: setPath(((obj[head] ?? {}) as Obj) || {}, rest, value) };
}

function getPath(obj: Obj, path: string[]): Json {
  let cur: Json = obj;
  for (const p of path) cur = cur && typeof cur === "object" && !Array.isArray(cur) ? ((cur as Obj)[p] ?? null) : null;
  return cur;
}

/** The form's first values: the schema's defaults, then the form's own (FORM_DEFAULTS). */
function startingSpec(): Obj {
  let spec = defaults(RUN_SPEC) as Obj;
  for (const [path, v] of Object.entries(FORM_DEFAULTS)) spec = setPath(spec, path.split("."), v);
  return spec;
}

/** The leaves under an object schema in form order, nested objects flattened (a workload's
 * params), constants left out (a variant's fixed kind: nothing to choose). */
function leavesOf(schema: JsonSchema, path: string[], skip?: string): [string[], JsonSchema][] {
  const out: [string[], JsonSchema][] = [];
  for (const [key, p] of Object.entries(resolve(schema).properties ?? {})) {
    const r = resolve(p);
    if (key === skip || r.const !== undefined) continue;
    if (r.properties && !variants(p)) out.push(...leavesOf(r, [...path, key]));
    else out.push([[...path, key], { ...p, description: p.description ?? r.description }]);
  }
  return inFormOrder(out);
}

interface FieldProps {
  path: string[];
  schema: JsonSchema;
  spec: Obj;
  errors: Record<string, string>;
  onChange: (path: string[], v: Json) => void;
  leaves: string[];
}

function Field({ path, schema, spec, errors, onChange, leaves }: FieldProps) {
  const id = path.join(".");
  leaves.push(id);
  const value = getPath(spec, path);
  const { schema: s, nullable: canBeNull } = nullable(schema);
  const options = s.enum ?? (s.const !== undefined ? [s.const] : null);
  const error = errors[id];
  let input: ComponentChildren;
  if (options) {
    input = (
      <select name={id} value={String(value ?? "")} disabled={options.length === 1} onChange={(e) => onChange(path, (e.target as HTMLSelectElement).value)}>
        {options.map((o) => <option value={String(o)}>{String(o)}</option>)}
      </select>
    );
  } else if (s.type === "boolean") {
    return (
      <label class={`field field-check ${error ? "has-error" : ""}`} data-field={id}>
        <span class="check">
          <input name={id} type="checkbox" checked={value === true} onChange={(e) => onChange(path, (e.target as HTMLInputElement).checked)} />
          {labelFor(path)}
        </span>
        <Help path={path} schema={s} error={error} id={id} />
      </label>
    );
  } else if (s.type === "array") {
    return <ListField path={path} schema={s} value={Array.isArray(value) ? (value as string[]) : []} error={error} onChange={onChange} />;
  } else if (s.type === "integer" || s.type === "number") {
    input = (
      <input name={id} type="number" inputMode="decimal" value={value === null || value === undefined ? "" : String(value)}
        placeholder={canBeNull ? "default" : undefined} step={s.type === "integer" ? 1 : "any"} min={s.minimum} max={s.maximum}
        onInput={(e) => {
          const raw = (e.target as HTMLInputElement).value;
          onChange(path, raw === "" ? (canBeNull ? null : "") : Number(raw));
        }} />
    );
  } else if (s.type === "object") {
    input = (
      <input name={id} type="text" class="mono" value={typeof value === "string" ? value : JSON.stringify(value ?? {})}
        onInput={(e) => {
          const raw = (e.target as HTMLInputElement).value;
          try {
            onChange(path, JSON.parse(raw) as Json);
          } catch {
            onChange(path, raw);
          }
        }} />
    );
  } else {
    input = (
      <input name={id} type="text" value={String(value ?? "")} placeholder={id === "name" ? defaultName(spec) : canBeNull ? "default" : undefined}
        onInput={(e) => onChange(path, (e.target as HTMLInputElement).value)} />
    );
  }
  return (
    <label class={`field ${error ? "has-error" : ""}`} data-field={id}>
      <span>{labelFor(path)}</span>
      {input}
      <Help path={path} schema={s} error={error} id={id} />
    </label>
  );
}

function Help({ path, schema, error, id }: { path: string[]; schema: JsonSchema; error?: string; id: string }) {
  const help = helpFor(path, schema);
  if (error) return <small class="field-error" data-testid={`error-${id}`}>{error}</small>;
  return help ? <small class="muted">{help}</small> : null;
}

/** A list of strings (a script's arguments): one box each, added and removed one at a time. */
function ListField({ path, schema, value, error, onChange }: { path: string[]; schema: JsonSchema; value: string[]; error?: string; onChange: (path: string[], v: Json) => void }) {
  const id = path.join(".");
  return (
    <div class={`field field-list ${error ? "has-error" : ""}`} data-field={id} data-testid={`list-${id}`}>
      <span>{labelFor(path)}</span>
      {value.map((item, i) => (
        <div class="list-row">
          <input name={`${id}.${i}`} type="text" class="mono" value={item} aria-label={`${labelFor(path)} ${i + 1}`}
            onInput={(e) => onChange(path, value.map((v, j) => (j === i ? (e.target as HTMLInputElement).value : v)))} />
          <button type="button" class="btn btn-small btn-ghost" aria-label={`remove argument ${i + 1}`} onClick={() => onChange(path, value.filter((_, j) => j !== i))}>
            ✕
          </button>
        </div>
      ))}
      <button type="button" class="btn btn-small" onClick={() => onChange(path, [...value, ""])} data-testid={`add-${id}`}>
        + Add argument
      </button>
      <Help path={path} schema={schema} error={error} id={id} />
    </div>
  );
}

/** A union (workload, strategy): its kind as a select, then the chosen variant's own fields. */
function Union({ path, schema, spec, errors, onChange, leaves }: FieldProps) {
  const u = variants(schema);
  if (!u) return null;
  const id = path.join(".");
  const obj = (getPath(spec, path) ?? {}) as Obj;
  const current = String(obj[u.tag] ?? "");
  const chosen = u.options.get(current);
  leaves.push(`${id}.${u.tag}`);
  const fields = chosen ? leavesOf(chosen, path, u.tag) : [];
  return (
    <fieldset class="section" data-testid={`group-${id}`}>
      <legend>{labelFor([...path, u.tag])}</legend>
      <div class="grid">
        <label class="field">
          <span>{labelFor([...path, u.tag])}</span>
          <select name={`${id}.${u.tag}`} value={current} disabled={u.options.size === 1}
            onChange={(e) => {
              const tag = (e.target as HTMLSelectElement).value;
              onChange(path, { ...(defaults(u.options.get(tag) ?? {}) as Obj), [u.tag]: tag });
            }}>
            {[...u.options.keys()].map((k) => <option value={k}>{k}</option>)}
          </select>
          {chosen?.description && <small class="muted">{chosen.description.split("\n")[0]}</small>}
        </label>
        {fields.map(([p, s]) => <Field path={p} schema={s} spec={spec} errors={errors} onChange={onChange} leaves={leaves} />)}
      </div>
    </fieldset>
  );
}

/** The schema of a top-level path ("training.lr", "workload"). */
function schemaAt(path: string[]): JsonSchema {
  let s: JsonSchema = RUN_SPEC;
  for (const p of path) {
    const r = resolve(s);
    const next = r.properties?.[p];
    if (!next) return {};
    s = { ...next, description: next.description ?? resolve(next).description };
  }
  return s;
}

export function NewRun({ route }: { route: Route }) {
  const from = route.query.get("from");
  const [spec, setSpec] = useState<Obj | null>(from ? null : startingSpec());
  const [advancedOpen, setAdvancedOpen] = useState(false);
  const [touched, setTouched] = useState(false);
  const [serverErrors, setServerErrors] = useState<Record<string, string>>({});
  const [formError, setFormError] = useState<string | null>(null);
  const [loadError, setLoadError] = useState<unknown>(undefined);
  const [busy, setBusy] = useState(false);
  const [recent, setRecent] = useState<{ id: number; name: string }[]>([]);

  useEffect(() => {
    api.GET("/api/v1/runs", { params: { query: { limit: 50 } } }).then(
      (r) => r.data && setRecent(r.data.items.map((x) => ({ id: x.id, name: x.name }))),
      () => undefined,
    );
  }, []);

  useEffect(() => {
    if (!from) {
      setSpec(startingSpec());
      return;
    }
    setSpec(null);
    api.GET("/api/v1/runs/{run_id}", { params: { path: { run_id: Number(from) } } }).then(
      (r) => {
        const run = ok(r);
        setSpec({ ...(run.spec as Obj), name: `${run.name} (clone)` });
      },
      (e) => setLoadError(e),
    );
  }, [from]);

  const browserErrors = useMemo(() => (spec ? { ...validate(RUN_SPEC, submitted(spec)), ...crossChecks(spec) } : {}), [spec]);
  if (loadError !== undefined) return <ErrorBox error={loadError} />;
  if (!spec) return <Loading what="Loading the run to clone" />;

  const errors = { ...(touched ? browserErrors : {}), ...serverErrors };
  const leaves: string[] = [];
  const advanced = inFormOrder([...leavesOf(schemaAt(["training"]), ["training"]), ...leavesOf(schemaAt(["resources"]), ["resources"])]).filter(
    ([p]) => !MAIN.includes(p.join(".")) && applies(p.join("."), spec),
  );
  const advancedError = advanced.some(([p]) => errors[p.join(".")] !== undefined);
  const onChange = (path: string[], v: Json) => {
    setSpec((s) => setPath(s ?? {}, path, v));
    const id = path.join(".");
    setServerErrors((e) => Object.fromEntries(Object.entries(e).filter(([k]) => !k.startsWith(id))));
  };

  const submit = async (e: Event) => {
    e.preventDefault();
    setTouched(true);
    setFormError(null);
    if (Object.keys(browserErrors).length) {
      // Marked fields say what is wrong; an error on a field the form does not show must be said
      // here, or Submit would do nothing, silently.
      const unshown = Object.entries(browserErrors).filter(([field]) => !leaves.includes(field));
      if (unshown.length) setFormError(unshown.map(([field, msg]) => `${field}: ${msg}`).join("; "));
      return;
    }
    setBusy(true);
    try {
      const run = ok(await api.POST("/api/v1/runs", { body: submitted(spec) as unknown as RunSpecIn }));
      go(`#/runs/${run.id}`);
    } catch (err) {
      if (err instanceof ApiError && err.status === 422) {
        const mapped: Record<string, string> = {};
        const loose: string[] = [];
        for (const fe of err.fieldErrors) {
          const field = fieldForError(fe.loc, fe.msg, leaves, spec);
          if (field) mapped[field] = fe.msg;
          else loose.push(fe.msg);
        }
        if (!err.fieldErrors.length) loose.push(String(err.detail));
        setServerErrors(mapped);
        setFormError(loose.length ? loose.join("; ") : "The server rejected the spec: see the marked fields.");
      } else {
        setFormError(err instanceof Error ? err.message : String(err));
      }
    } finally {
      setBusy(false);
    }
  };

  return (
    <section>
      <div class="page-head">
        <h1>New run</h1>
        <div class="actions">
          <label class="inline">
            <span class="muted">Clone from run</span>
            <select value={from ?? ""} onChange={(e) => {
              const id = (e.target as HTMLSelectElement).value;
              go(id ? `#/new?from=${id}` : "#/new");
            }} data-testid="clone-from">
              <option value="">— defaults —</option>
              {recent.map((r) => <option value={String(r.id)}>#{r.id} {r.name}</option>)}
            </select>
          </label>
        </div>
      </div>
      <form class="card spec-form" onSubmit={submit} noValidate data-testid="new-run-form">
        {mainBlocks(spec, errors, onChange, leaves)}
        <details class="advanced" open={advancedOpen || advancedError} onToggle={(e) => setAdvancedOpen((e.target as HTMLDetailsElement).open)} data-testid="advanced">
          <summary>
            Advanced <span class="muted">· {advanced.map(([p]) => labelFor(p).toLowerCase()).join(", ")}</span>
          </summary>
          <div class="grid">
            {advanced.map(([p, sch]) => <Field path={p} schema={sch} spec={spec} errors={errors} onChange={onChange} leaves={leaves} />)}
          </div>
        </details>
        {formError && <div class="form-error" role="alert" data-testid="form-error">{formError}</div>}
        <div class="form-actions">
          <button class="btn btn-primary" type="submit" disabled={busy} data-testid="submit-run">
            {busy ? "Submitting…" : "Submit run"}
          </button>
          <a class="btn btn-ghost" href="#/runs">Cancel</a>
        </div>
      </form>
    </section>
  );
}

/** The main section: MAIN's paths in order, consecutive plain fields sharing a grid. */
function mainBlocks(spec: Obj, errors: Record<string, string>, onChange: (path: string[], v: Json) => void, leaves: string[]) {
  const blocks: ComponentChildren[] = [];
  let row: ComponentChildren[] = [];
  const flush = () => {
    if (row.length) blocks.push(<div class="grid main-grid">{row}</div>);
    row = [];
  };
  for (const id of MAIN.filter((p) => applies(p, spec))) {
    const path = id.split(".");
    const schema = schemaAt(path);
    if (variants(schema)) {
      flush();
      blocks.push(<Union path={path} schema={schema} spec={spec} errors={errors} onChange={onChange} leaves={leaves} />);
    } else {
      row.push(<Field path={path} schema={schema} spec={spec} errors={errors} onChange={onChange} leaves={leaves} />);
    }
  }
  flush();
  return blocks;
}
