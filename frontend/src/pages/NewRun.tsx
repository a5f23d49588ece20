import { useEffect, useMemo, useState } from "preact/hooks";
import { api, ApiError, ok, type RunSpecIn } from "../api/client";
import { ErrorBox, Loading } from "../components/ui";
import { go, type Route } from "../lib/route";
import {
  crossChecks,
  defaults,
  fieldForError,
  resolve,
  RUN_SPEC,
  validate,
  variants,
  type Json,
  type JsonSchema,
  type Obj,
} from "../lib/specform";

const SECTION_ORDER = ["name", "workload", "strategy", "resources", "training"];

function setPath(obj: Obj, path: string[], value: Json): Obj {
  const [head, ...rest] = path;
  if (head === undefined) return obj;
  if (!rest.length) return { ...obj, [head]: value };
  return { ...obj, [head]: setPath(((obj[head] ?? {}) as Obj) || {}, rest, value) };
}

function label(key: string, s: JsonSchema): string {
  return s.title ?? key.replace(/_/g, " ");
}

interface FieldsProps {
  schema: JsonSchema;
  value: Obj;
  path: string[];
  errors: Record<string, string>;
  onChange: (path: string[], v: Json) => void;
  leaves: string[];
}

function Leaf({ name, schema, value, path, error, onChange }: {
  name: string;
  schema: JsonSchema;
  value: Json;
  path: string[];
  error?: string;
  onChange: (path: string[], v: Json) => void;
}) {
  const id = path.join(".");
  const options = schema.enum ?? (schema.const !== undefined ? [schema.const] : null);
  let input;
  if (options) {
    input = (
      <select name={id} value={String(value ?? "")} disabled={options.length === 1}
        onChange={(e) => onChange(path, (e.target as HTMLSelectElement).value)}>
        {options.map((o) => <option value={String(o)}>{String(o)}</option>)}
      </select>
    );
  } else if (schema.type === "integer" || schema.type === "number") {
    input = (
      <input name={id} type="number" inputMode="decimal" value={typeof value === "number" ? String(value) : String(value ?? "")}
        step={schema.type === "integer" ? 1 : "any"} min={schema.minimum} max={schema.maximum}
        onInput={(e) => {
          const raw = (e.target as HTMLInputElement).value;
          onChange(path, raw === "" ? "" : Number(raw));
        }} />
    );
  } else if (schema.type === "object") {
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
      <input name={id} type="text" value={String(value ?? "")}
        onInput={(e) => onChange(path, (e.target as HTMLInputElement).value)} />
    );
  }
  return (
    <label class={`field ${error ? "has-error" : ""}`} data-field={id}>
      <span>{label(name, schema)}</span>
      {input}
      {schema.description && !error && <small class="muted">{schema.description}</small>}
      {error && <small class="field-error" data-testid={`error-${id}`}>{error}</small>}
    </label>
  );
}

function Fields({ schema, value, path, errors, onChange, leaves }: FieldsProps) {
  const r = resolve(schema);
  const props = Object.entries(r.properties ?? {});
  if (!path.length) props.sort(([a], [b]) => SECTION_ORDER.indexOf(a) - SECTION_ORDER.indexOf(b));
  return (
    <>
      {props.map(([key, p]) => {
        const at = [...path, key];
        const id = at.join(".");
        const u = variants(p);
        const rp = resolve(p);
        const v = value[key] ?? null;
        if (u) {
          const obj = (v ?? {}) as Obj;
          const current = String(obj[u.tag] ?? "");
          const chosen = u.options.get(current);
          leaves.push(`${id}.${u.tag}`);
          return (
            <fieldset class="section">
              <legend>{label(key, p)}</legend>
              <label class="field">
                <span>{u.tag}</span>
                <select name={`${id}.${u.tag}`} value={current} disabled={u.options.size === 1}
                  onChange={(e) => {
                    const tag = (e.target as HTMLSelectElement).value;
                    const variant = u.options.get(tag) ?? {};
                    onChange(at, { ...(defaults(variant) as Obj), [u.tag]: tag });
                  }}>
                  {[...u.options.keys()].map((k) => <option value={k}>{k}</option>)}
                </select>
              </label>
              {chosen && (
                <Fields schema={{ properties: Object.fromEntries(Object.entries(chosen.properties ?? {}).filter(([k]) => k !== u.tag)) }}
                  value={obj} path={at} errors={errors} onChange={onChange} leaves={leaves} />
              )}
            </fieldset>
          );
        }
        if (rp.properties) {
          return (
            <fieldset class={path.length ? "sub" : "section"}>
              <legend>{label(key, p)}</legend>
              <div class="grid">
                <Fields schema={rp} value={(v ?? {}) as Obj} path={at} errors={errors} onChange={onChange} leaves={leaves} />
              </div>
            </fieldset>
          );
        }
        leaves.push(id);
        return <Leaf name={key} schema={{ ...rp, description: p.description ?? rp.description }} value={v} path={at} error={errors[id]} onChange={onChange} />;
      })}
    </>
  );
}

export function NewRun({ route }: { route: Route }) {
  const from = route.query.get("from");
  const [spec, setSpec] = useState<Obj | null>(from ? null : (defaults(RUN_SPEC) as Obj));
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
      setSpec(defaults(RUN_SPEC) as Obj);
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

  const browserErrors = useMemo(() => (spec ? { ...validate(RUN_SPEC, spec), ...crossChecks(spec) } : {}), [spec]);
  if (loadError !== undefined) return <ErrorBox error={loadError} />;
  if (!spec) return <Loading what="Loading the run to clone" />;

  const errors = { ...(touched ? browserErrors : {}), ...serverErrors };
  const leaves: string[] = [];
  const onChange = (path: string[], v: Json) => {
    setSpec((s) => setPath(s ?? {}, path, v));
    const id = path.join(".");
    setServerErrors((e) => Object.fromEntries(Object.entries(e).filter(([k]) => !k.startsWith(id))));
  };

  const submit = async (e: Event) => {
    e.preventDefault();
    setTouched(true);
    setFormError(null);
    if (Object.keys(browserErrors).length) return;
    setBusy(true);
    try {
      const run = ok(await api.POST("/api/v1/runs", { body: spec as unknown as RunSpecIn }));
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
        <Fields schema={RUN_SPEC} value={spec} path={[]} errors={errors} onChange={onChange} leaves={leaves} />
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
