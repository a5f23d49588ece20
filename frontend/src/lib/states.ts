// A run's states, spelled once for the dashboard. The list is checked against the api's RunState enum
// (generated from openapi.json, itself from torchyard/states.py): a state added or renamed there fails
// the build here until this list follows.
import type { components } from "../api/schema";

export type RunState = components["schemas"]["RunState"];

const ALL = {
  queued: true,
  scheduled: true,
  running: true,
  restarting: true,
  cancelling: true,
  succeeded: true,
  failed: true,
  cancelled: true,
} satisfies Record<RunState, true>;

/** Every state, in the order a run goes through them (the runs page's filter). */
export const RUN_STATES = Object.keys(ALL) as RunState[];

/** The states a run never leaves (torchyard/states.py TERMINAL). */
export const TERMINAL: ReadonlySet<string> = new Set<RunState>(["succeeded", "failed", "cancelled"]);
