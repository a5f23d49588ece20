// A small read-only window into the page's state for the browser tests (tests/test_ui.py):
// window.__torchyard.series("loss"), .chart("chart-loss"), .stream(). Each returns copies.
type Hook = (...args: string[]) => unknown;

interface Hooks {
  [name: string]: Hook;
}

function hooks(): Hooks {
  const w = window as unknown as { __torchyard?: Hooks };
  w.__torchyard ??= {};
  return w.__torchyard;
}

/** Registers (or, with null, removes) one read-only hook. */
export function expose(name: string, hook: Hook | null): void {
  const h = hooks();
  if (hook) h[name] = hook;
  else delete h[name];
}

// Charts by test id, registered by components/Chart.
const charts = new Map<string, () => unknown>();
expose("chart", (id: string) => charts.get(id)?.() ?? null);

export function exposeChart(id: string, read: (() => unknown) | null): void {
  if (read) charts.set(id, read);
  else charts.delete(id);
}
