import type { ComponentChildren } from "preact";
import { useEffect, useRef, useState } from "preact/hooks";

export function StatusBadge({ status }: { status: string }) {
  return (
    <span class={`badge badge-${status}`} data-testid="status">
      {status}
    </span>
  );
}

export function Loading({ what = "Loading" }: { what?: string }) {
  return (
    <div class="state state-loading" role="status">
      <span class="spinner" /> {what}…
    </div>
  );
}

export function Empty({ children }: { children: ComponentChildren }) {
  return <div class="state state-empty">{children}</div>;
}

export function ErrorBox({ error, retry }: { error: unknown; retry?: () => void }) {
  const text = error instanceof Error ? error.message : String(error);
  return (
    <div class="state state-error" role="alert">
      <strong>Something went wrong.</strong> {text}
      {retry && (
        <button class="btn btn-small" onClick={retry}>
          Retry
        </button>
      )}
    </div>
  );
}

/** ``total`` null: not known yet (a script says how many steps it runs only by running them). */
export function Progress({ value, total }: { value: number; total: number | null }) {
  if (total === null) {
    return (
      <div class="progress" title={`step ${value}`} role="progressbar">
        <span class="progress-text">step {value.toLocaleString("en-US")}</span>
      </div>
    );
  }
  const pct = total > 0 ? Math.min(100, (100 * value) / total) : 0;
  return (
    <div
      class="progress"
      title={`${value} / ${total}`}
      role="progressbar"
      aria-valuemin={0}
      aria-valuemax={100}
      aria-valuenow={Math.round(pct)}
    >
      <div class="progress-bar" style={{ width: `${pct}%` }} />
      <span class="progress-text">
        {value.toLocaleString("en-US")} / {total.toLocaleString("en-US")}
      </span>
    </div>
  );
}

/** Loads with `load` now and every `everyMs` (when given); keeps the last good data on error. */
export function usePoll<T>(load: () => Promise<T>, deps: unknown[], everyMs?: number) {
  const [data, setData] = useState<T | undefined>(undefined);
  const [error, setError] = useState<unknown>(undefined);
  const [tick, setTick] = useState(0);
  const alive = useRef(true);
  useEffect(() => {
    alive.current = true;
    let timer: number | undefined;
    const run = async () => {
      try {
        const d = await load();
        if (!alive.current) return;
        setData(d);
        setError(undefined);
      } catch (e) {
        if (alive.current) setError(e);
      }
      if (alive.current && everyMs) timer = window.setTimeout(run, everyMs);
    };
    void run();
    return () => {
      alive.current = false;
      window.clearTimeout(timer);
    };
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [...deps, tick]);
  return { data, error, reload: () => setTick((t) => t + 1), setData };
}
