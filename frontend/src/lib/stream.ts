// One run's live stream (SSE). The browser's EventSource reconnects by itself and sends
// Last-Event-ID, so the server resumes with no gap and no repeat (what its streams no longer hold
// comes from the database first, as the same events with the same ids); when the source gives up
// (the api answered an error while restarting) we open a new one from the last id we saw.
import type { IngestedEvent, LogsEvent, MetricsEvent, StateEvent } from "../api/client";
import { setOnline } from "./connection";
import { TERMINAL } from "./states";

export interface StreamHandlers {
  metrics?: (e: MetricsEvent) => void;
  logs?: (e: LogsEvent) => void;
  state?: (e: StateEvent) => void;
  report?: (e: unknown) => void;
  ingested?: (e: IngestedEvent) => void;
}


export class RunStream {
  private source: EventSource | null = null;
  private lastId: string;
  private closed = false;
  private retry: number | undefined;
  /** Each connection the page opened itself (the browser's own reconnects are not in here). */
  readonly opens: { since: string; at: number }[] = [];
  connected = false;

  constructor(
    private runId: number,
    since: string,
    private handlers: StreamHandlers,
  ) {
    this.lastId = since;
    this.open();
  }

  private open(): void {
    const url = `/api/v1/runs/${this.runId}/stream?since=${encodeURIComponent(this.lastId)}`;
    const source = new EventSource(url, { withCredentials: true });
    this.source = source;
    this.opens.push({ since: this.lastId, at: Date.now() });
    source.onopen = () => {
      this.connected = true;
      setOnline(true);
    };
    source.onerror = () => {
      if (this.closed) return;
      this.connected = false;
      setOnline(false);
      if (source.readyState === EventSource.CLOSED) {
        this.retry = window.setTimeout(() => this.open(), 2000);
      }
    };
    const on = <T>(type: string, handle: ((data: T) => void) | undefined, after?: (data: T) => void) => {
      source.addEventListener(type, (ev) => {
        const msg = ev as MessageEvent<string>;
        if (msg.lastEventId) this.lastId = msg.lastEventId;
        const data = JSON.parse(msg.data) as T;
        handle?.(data);
        after?.(data);
      });
    };
    on<MetricsEvent>("metrics", this.handlers.metrics);
    on<LogsEvent>("logs", this.handlers.logs);
    on<unknown>("report", this.handlers.report);
    on<IngestedEvent>("ingested", this.handlers.ingested);
    on<StateEvent>("state", this.handlers.state, (s) => {
      if (TERMINAL.has(s.status)) this.close(); // the server ends the stream after this
    });
  }

  /** Where the stream stands, for the browser tests' debug hook. */
  debug(): { lastId: string; opens: { since: string; at: number }[]; connected: boolean; closed: boolean } {
    return { lastId: this.lastId, opens: this.opens.slice(), connected: this.connected, closed: this.closed };
  }

  close(): void {
    this.closed = true;
    window.clearTimeout(this.retry);
    this.source?.close();
  }
}

/** A stream id a little before now: the live view starts there and drops points the history
 * already holds (stream ids are Redis's millisecond clock). */
export function sinceAgo(seconds: number): string {
  return `${Date.now() - seconds * 1000}-0`;
}
