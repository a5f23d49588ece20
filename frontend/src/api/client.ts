// The typed api client: openapi-fetch over the types openapi-typescript generates from
// openapi.json (src/api/schema.d.ts is generated at build time, never edited by hand).
import createClient from "openapi-fetch";
import type { components, paths } from "./schema";
import { setOnline } from "../lib/connection";

export type Run = components["schemas"]["RunOut"];
export type RunPage = components["schemas"]["RunPage"];
export type StrategyComparison = components["schemas"]["StrategyComparison"];
export type RunEvent = components["schemas"]["EventOut"];
export type LogLine = components["schemas"]["LogLineOut"];
export type Node = components["schemas"]["NodeOut"];
export type Gpu = components["schemas"]["GpuOut"];
export type MetricSeries = components["schemas"]["MetricSeries"];
export type Me = components["schemas"]["MeOut"];
export type RunSpecIn = components["schemas"]["RunSpec"];
export type Checkpoint = components["schemas"]["CheckpointOut"];

export interface FieldError {
  loc: (string | number)[];
  msg: string;
}

export class ApiError extends Error {
  constructor(
    public status: number,
    public detail: unknown,
  ) {
    super(typeof detail === "string" ? detail : `HTTP ${status}`);
  }
  /** FastAPI's 422 list: [{loc, msg}], or a plain string detail. */
  get fieldErrors(): FieldError[] {
    return Array.isArray(this.detail) ? (this.detail as FieldError[]) : [];
  }
}

async function tracked(input: Request): Promise<Response> {
  try {
    const response = await fetch(input);
    setOnline(true);
    if (response.status === 401 && !location.hash.startsWith("#/login")) {
      location.hash = "#/login";
    }
    return response;
  } catch (err) {
    setOnline(false);
    throw err;
  }
}

export const api = createClient<paths>({ baseUrl: "", fetch: tracked, credentials: "same-origin" });

/** The data of an openapi-fetch result, or an ApiError carrying the server's detail. */
export function ok<T>(result: { data?: T; error?: unknown; response: Response }): T {
  if (result.error !== undefined || !result.response.ok) {
    const err = result.error as { detail?: unknown } | undefined;
    throw new ApiError(result.response.status, err?.detail ?? result.response.statusText);
  }
  return result.data as T;
}

export async function fetchSeries(
  runId: number,
  key: string,
  maxPoints: number,
  stepMin?: number,
  stepMax?: number,
): Promise<MetricSeries> {
  const query: { key: string; max_points: number; step_min?: number; step_max?: number } = {
    key,
    max_points: Math.max(2, Math.min(10_000, Math.round(maxPoints))), // the server's most (backend/metrics.py MAX_POINTS)
  };
  if (stepMin !== undefined) query.step_min = Math.max(0, Math.floor(stepMin));
  if (stepMax !== undefined) query.step_max = Math.max(0, Math.ceil(stepMax));
  const result = await api.GET("/api/v1/runs/{run_id}/metrics", { params: { path: { run_id: runId }, query } });
  return ok(result) as MetricSeries;
}

// The live stream's events (SSE is outside OpenAPI): see backend/routes/runs.py.
export type Scalars = Record<string, number | null>;
export interface MetricsEvent {
  attempt: number;
  rank: number;
  points: [number, number, Scalars][];
}
export interface LogsEvent {
  attempt: number;
  lines: [number, number, string][];
}
/** Ingest's word on a live run, about once a second (torchyard/streams.py ``ingested``). */
export interface IngestedEvent {
  lag_s: number; // how far behind the ranks storage is
  sdk_dropped: Record<string, number>; // rank → points its SDK dropped at its buffer bound (this attempt)
}
export interface StateEvent {
  status: string;
  from: string | null;
  reason: string;
  at: string;
}
