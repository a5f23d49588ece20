// Formatting for tables and chart axes: short, unit-bearing, never "NaN".

export function fmtNumber(v: number | null | undefined, digits = 3): string {
  if (v === null || v === undefined || !Number.isFinite(v)) return "—";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(2);
  if (a >= 1000) return Math.round(v).toLocaleString("en-US");
  return Number(v.toPrecision(digits)).toString();
}

/** Axis ticks: SI suffixes for large values, plain digits otherwise. */
export function fmtAxis(v: number | null | undefined): string {
  if (v === null || v === undefined || !Number.isFinite(v)) return "";
  return Math.abs(v) >= 10_000 ? fmtSI(v) : fmtNumber(v);
}

const SI = ["", "k", "M", "G", "T"];

/** 1234.5 → "1.23k": throughput in a table cell. */
export function fmtSI(v: number | null | undefined, digits = 3): string {
  if (v === null || v === undefined || !Number.isFinite(v)) return "—";
  let x = v;
  let i = 0;
  while (Math.abs(x) >= 1000 && i < SI.length - 1) {
    x /= 1000;
    i++;
  }
  return `${Number(x.toPrecision(digits))}${SI[i]}`;
}

export function fmtPercent(v: number | null | undefined): string {
  if (v === null || v === undefined || !Number.isFinite(v)) return "—";
  return `${(v * 100).toFixed(v < 0.1 ? 1 : 0)}%`;
}

/** Seconds → "850 ms", "12.3 s", "4m 05s", "2h 03m", "3d 4h". */
export function fmtDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds) || seconds < 0) return "—";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
  const m = Math.floor(seconds / 60);
  if (m < 60) return `${m}m ${String(Math.floor(seconds % 60)).padStart(2, "0")}s`;
  const h = Math.floor(m / 60);
  if (h < 24) return `${h}h ${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(h / 24)}d ${h % 24}h`;
}

/** Time since `iso` as "5s ago", "3m ago", "2h ago", "4d ago". */
export function fmtAge(iso: string | null | undefined, now: number = Date.now()): string {
  const t = parseTime(iso);
  if (t === null) return "—";
  const s = Math.max(0, (now - t) / 1000);
  if (s < 60) return `${Math.floor(s)}s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m ago`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ago`;
  return `${Math.floor(s / 86400)}d ago`;
}

/** The api's datetimes are UTC; SQLite gives them without a zone: read those as UTC too. */
export function parseTime(iso: string | null | undefined): number | null {
  if (!iso) return null;
  const zoned = /[zZ]|[+-]\d\d:?\d\d$/.test(iso) ? iso : `${iso}Z`;
  const t = Date.parse(zoned);
  return Number.isNaN(t) ? null : t;
}

export function fmtClock(iso: string | null | undefined): string {
  const t = parseTime(iso);
  if (t === null) return "—";
  return new Date(t).toLocaleString("en-GB", { hour12: false });
}

export function fmtTs(ts: number): string {
  const d = new Date(ts * 1000);
  return `${d.toLocaleTimeString("en-GB", { hour12: false })}.${String(d.getMilliseconds()).padStart(3, "0")}`;
}

/** Bytes → "812 B", "3.4 KiB", "1.2 GiB". */
export function fmtBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !Number.isFinite(n) || n < 0) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let x = n;
  let i = 0;
  while (x >= 1024 && i < units.length - 1) {
    x /= 1024;
    i++;
  }
  return i === 0 ? `${x} B` : `${x.toFixed(x < 10 ? 2 : 1)} ${units[i]}`;
}

/** A chart's y labels (axis ticks, legend values) for what its values are. */
export function formatter(format: "number" | "seconds" | "bytes" | "percent" | undefined): {
  axis: (v: number) => string;
  value: (v: number) => string;
} {
  switch (format) {
    case "bytes":
      return { axis: fmtBytes, value: fmtBytes };
    case "percent":
      return { axis: fmtPercent, value: fmtPercent };
    case "seconds":
      return { axis: fmtAxis, value: (v) => `${fmtNumber(v, 4)} s` };
    default:
      return { axis: fmtAxis, value: (v) => fmtNumber(v, 4) };
  }
}
