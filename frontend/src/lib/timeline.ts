// One sampled step (torch.profiler) as rows of rectangles: each rank's lanes, compute and
// communication, on one shared µs axis so ranks line up.
import type { components } from "../api/schema";

export type StepTimelines = components["schemas"]["StepTimelines"];

export interface Rect {
  x: number; // fraction of the axis, 0..1
  w: number;
  name: string;
  startUs: number;
  durUs: number;
}

export interface TimelineRow {
  rank: number;
  label: string;
  kind: "compute" | "comm" | "copy";
  rects: Rect[];
  dropped: number;
}

const KIND_ORDER = { compute: 0, copy: 1, comm: 2 }; // copies (CUDA memcpy/memset) are neither compute nor comm

/** Rows for every rank's lanes, ranks in order, compute lanes, then copies, then comm; widths of at
 * least ``minW`` (a 3 µs op stays visible on a 30 ms axis). */
export function timelineRows(data: StepTimelines, minW = 0.002): { rows: TimelineRow[]; axisUs: number } {
  const ranks = Object.keys(data.ranks)
    .map(Number)
    .sort((a, b) => a - b);
  const axisUs = Math.max(1, ...ranks.map((r) => data.ranks[String(r)]?.duration_us ?? 0));
  const rows: TimelineRow[] = [];
  for (const rank of ranks) {
    const t = data.ranks[String(rank)];
    if (!t) continue;
    const lanes = [...t.lanes].sort((a, b) => KIND_ORDER[a.kind] - KIND_ORDER[b.kind] || a.label.localeCompare(b.label));
    for (const lane of lanes) {
      rows.push({
        rank,
        label: lane.label,
        kind: lane.kind,
        dropped: lane.dropped,
        rects: lane.spans.map(([start = 0, dur = 0, name = 0]) => ({
          x: start / axisUs,
          w: Math.max(minW, dur / axisUs),
          name: t.names[name] ?? "?",
          startUs: start,
          durUs: dur,
        })),
      });
    }
  }
  return { rows, axisUs };
}
