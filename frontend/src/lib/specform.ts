// The new-run form is built from the run spec's JSON Schema in openapi.json (the same file the
// typed client comes from): sections, fields, bounds, defaults and workload variants follow the
// server's pydantic models, so a field added there appears here after `npm run build`.
import openapi from "../../openapi.json";

export interface JsonSchema {
  $ref?: string;
  type?: string;
  title?: string;
  description?: string;
  default?: unknown;
  enum?: unknown[];
  const?: unknown;
  minimum?: number;
  maximum?: number;
  exclusiveMinimum?: number;
  exclusiveMaximum?: number;
  minLength?: number;
  maxLength?: number;
  items?: JsonSchema;
  maxItems?: number;
  properties?: Record<string, JsonSchema>;
  required?: string[];
  oneOf?: JsonSchema[];
  anyOf?: JsonSchema[];
  discriminator?: { propertyName: string; mapping?: Record<string, string> };
  additionalProperties?: boolean | JsonSchema;
}

const SCHEMAS = (openapi as unknown as { components: { schemas: Record<string, JsonSchema> } }).components.schemas;

export function resolve(s: JsonSchema, schemas = SCHEMAS): JsonSchema {
  let cur = s;
  while (cur.$ref) cur = schemas[cur.$ref.split("/").pop() as string] ?? {};
  return cur;
}

export const RUN_SPEC: JsonSchema = SCHEMAS["RunSpec"] ?? {};

/** ``X | None`` in the schema (anyOf [X, null]): X, marked nullable (empty means "the default"). */
export function nullable(s: JsonSchema, schemas = SCHEMAS): { schema: JsonSchema; nullable: boolean } {
  const r = resolve(s, schemas);
  const list = r.anyOf;
  if (list && list.some((x) => x.type === "null")) {
    const other = list.find((x) => x.type !== "null") ?? {};
    return { schema: { ...resolve(other, schemas), description: s.description ?? r.description }, nullable: true };
  }
  return { schema: r, nullable: false };
}

export type Json = null | boolean | number | string | Json[] | { [k: string]: Json };
export type Obj = { [k: string]: Json };

/** A discriminated union's variants: tag value → schema. */
export function variants(s: JsonSchema, schemas = SCHEMAS): { tag: string; options: Map<string, JsonSchema> } | null {
  const list = s.oneOf ?? s.anyOf;
  if (!list || !s.discriminator) {
    const r = resolve(s, schemas);
    if (r !== s) return variants(r, schemas);
    return null;
  }
  const tag = s.discriminator.propertyName;
  const options = new Map<string, JsonSchema>();
  for (const v of list) {
    const r = resolve(v, schemas);
    const p = r.properties?.[tag];
    const value = p?.const ?? p?.enum?.[0];
    if (typeof value === "string") options.set(value, r);
  }
  return { tag, options };
}

/** The schema's defaults as a value (objects recursively; a union's first variant). */
export function defaults(s: JsonSchema, schemas = SCHEMAS): Json {
  const u = variants(s, schemas);
  if (u) {
    const [tagValue, first] = [...u.options.entries()][0] ?? ["", {}];
    return { ...(defaults(first, schemas) as Obj), [u.tag]: tagValue };
  }
  const r = resolve(s, schemas);
  if (r.properties) {
    const out: Obj = {};
    for (const [k, p] of Object.entries(r.properties)) {
      const rp = resolve(p, schemas);
      if (rp.const !== undefined) out[k] = rp.const as Json;
      else if (p.default !== undefined && !(rp.properties && typeof p.default === "object")) out[k] = p.default as Json;
      else if (rp.properties || variants(p, schemas)) out[k] = defaults(p, schemas);
      else if (rp.default !== undefined) out[k] = rp.default as Json;
      else if (rp.type === "string") out[k] = "";
      else if (rp.type === "object") out[k] = {};
    }
    return out;
  }
  return (r.default as Json) ?? null;
}

/** One leaf's browser-side check against its schema: a message, or null. */
export function checkLeaf(s: JsonSchema, value: Json): string | null {
  if (s.type === "integer" || s.type === "number") {
    if (typeof value !== "number" || Number.isNaN(value)) return "must be a number";
    if (s.type === "integer" && !Number.isInteger(value)) return "must be a whole number";
    if (s.minimum !== undefined && value < s.minimum) return `must be ≥ ${s.minimum}`;
    if (s.maximum !== undefined && value > s.maximum) return `must be ≤ ${s.maximum}`;
    if (s.exclusiveMinimum !== undefined && value <= s.exclusiveMinimum) return `must be > ${s.exclusiveMinimum}`;
    if (s.exclusiveMaximum !== undefined && value >= s.exclusiveMaximum) return `must be < ${s.exclusiveMaximum}`;
  }
  if (s.type === "string") {
    if (typeof value !== "string") return "required";
    if (s.minLength !== undefined && value.length < s.minLength) return value.length ? `at least ${s.minLength} characters` : "required";
    if (s.maxLength !== undefined && value.length > s.maxLength) return `at most ${s.maxLength} characters`;
  }
  return null;
}

/** Every leaf error of `value` under schema `s`, keyed by dotted path. A field left out (undefined)
 * takes the server's default: only a required one is an error. */
export function validate(s: JsonSchema, value: Json, path = "", out: Record<string, string> = {}, schemas = SCHEMAS) {
  const u = variants(s, schemas);
  const obj = (value ?? {}) as Obj;
  const { schema: r, nullable: canBeNull } = u ? { schema: u.options.get(String(obj[u.tag])), nullable: false } : nullable(s, schemas);
  if (!r) {
    if (u) out[`${path}.${u.tag}`] = "choose one";
    return out;
  }
  // An optional section left out (the server's own specs say `"data": null`) has nothing to check
  // inside: checked first, or a cloned run's null section failed on its required fields, unshown.
  if (canBeNull && (value === null || value === "")) return out;
  if (r.properties) {
    for (const [k, p] of Object.entries(r.properties)) {
      const v = obj[k];
      if (v === undefined && !(r.required ?? []).includes(k)) continue;
      validate(p, v ?? null, path ? `${path}.${k}` : k, out, schemas);
    }
    return out;
  }
  if (r.type === "object" && typeof value === "string") {
    out[path] = "must be a JSON object";
    return out;
  }
  if (r.type === "array") {
    if (!Array.isArray(value)) out[path] = "must be a list";
    else if (r.maxItems !== undefined && value.length > r.maxItems) out[path] = `at most ${r.maxItems} items`;
    return out;
  }
  if (r.type === "boolean") {
    if (typeof value !== "boolean") out[path] = "must be true or false";
    return out;
  }
  const msg = checkLeaf(r, value);
  if (msg) out[path] = msg;
  return out;
}

/** Rules across fields that the server checks in its model validators. */
export function crossChecks(spec: Obj): Record<string, string> {
  const out: Record<string, string> = {};
  const res = (spec.resources ?? {}) as Obj;
  const tr = (spec.training ?? {}) as Obj;
  const world = Number(res.nodes ?? 1) * Number(res.procs_per_node ?? 1);
  const batch = Number(tr.batch_size);
  if (world > 0 && Number.isInteger(batch) && batch % world !== 0) {
    out["training.batch_size"] = `must be divisible by nodes × procs_per_node (${world})`;
  }
  return out;
}

/**
 * Where a server 422 belongs: FastAPI's loc (["body", "workload", "mlp", "params", "hidden"])
 * as the form's dotted path (union tags dropped). A model-level error (loc ["body"]) goes to the
 * first field path its message names.
 */
export function fieldForError(loc: (string | number)[], msg: string, known: string[], spec: Obj): string | null {
  const parts = loc.filter((p) => p !== "body").map(String);
  const kept: string[] = [];
  let cur: Json = spec;
  for (const p of parts) {
    const obj = cur as Obj | null;
    if (obj && typeof obj === "object" && !Array.isArray(obj) && p in obj) {
      kept.push(p);
      cur = obj[p] ?? null;
    } // else: a union tag (or a dict key) FastAPI adds to loc: skip it
  }
  const path = kept.join(".");
  if (path && known.includes(path)) return path;
  const byPrefix = known.find((k) => path && k.startsWith(path + "."));
  if (byPrefix && parts.length > kept.length) return byPrefix;
  const named = [...known].sort((a, b) => b.length - a.length).find((k) => msg.includes(k));
  return named ?? (path && known.includes(path) ? path : null);
}
