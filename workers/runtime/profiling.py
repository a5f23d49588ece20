"""Sampled detail: every ``training.profile_every`` steps one step runs under ``torch.profiler``,
and the trace gives an independent measure of the step's communication:

- **comm intervals**: the collectives themselves. On Gloo they run on Gloo's own threads as
  ``gloo:<op>`` spans; on CUDA they are the NCCL kernels on the device.
- **compute intervals**: on CPU, every ``aten::`` op (forward, backward, optimizer) except those
  inside a collective or its launch (``c10d::*``); on CUDA every other device kernel.
- ``prof_comm_time_s`` = the comm intervals' union; ``prof_exposed_comm_s`` = the part of it
  when no compute runs; ``prof_overlap_fraction`` = 1 − exposed / comm. Python between ops counts
  as not computing, so on CPU the exposed figure is an upper bound.

The step is also kept as a compact timeline (lanes of ``[start µs, duration µs, name index]``
spans, at most ``MAX_SPANS`` per lane, the longest kept) for the run page."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

COMM_PREFIXES = ("gloo:", "nccl:")
LAUNCH_PREFIX = "c10d::"  # the training thread's side of a collective: a launch (or a wait), not compute
MAX_SPANS = 300


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of the intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def uncovered(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """How much of the disjoint sorted intervals ``a`` no interval of ``b`` (disjoint, sorted) covers."""
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        total += max(0.0, end - cursor)
    return total


@contextlib.contextmanager
def capture(cuda: bool) -> Iterator[profile]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield prof
        if cuda:  # the step's kernels finish inside the trace (once per sampled step, not per step)
            torch.cuda.synchronize()


def _span(event: Any) -> tuple[float, float]:
    return float(event.time_range.start), float(event.time_range.end)


def analyze(prof: profile, cuda: bool, step: int) -> tuple[dict[str, float], dict[str, Any]]:
    """The step's trace-derived figures (seconds) and its compact timeline."""
    events = list(prof.events())
    comm_lanes: dict[str, list[tuple[float, float, str]]] = {}
    compute_lanes: dict[str, list[tuple[float, float, str]]] = {}
    compute: list[tuple[float, float]] = []
    if cuda:
        for e in events:
            if e.device_type != DeviceType.CUDA:
                continue
            start, end = _span(e)
            lane = f"stream {e.device_index}:{getattr(e, 'stream', 0)}" if hasattr(e, "stream") else "device"
            if "nccl" in e.name.lower():
                comm_lanes.setdefault(lane, []).append((start, end, e.name[:60]))
            else:
                compute_lanes.setdefault(lane, []).append((start, end, e.name[:60]))
                compute.append((start, end))
    else:
        for e in events:
            start, end = _span(e)
            if e.name.startswith(COMM_PREFIXES):  # Gloo's threads; send/recv on the caller's own
                comm_lanes.setdefault(f"thread {e.thread}", []).append((start, end, e.name))
            elif e.cpu_parent is None:  # what the training thread was doing, as the timeline shows it
                compute_lanes.setdefault(f"thread {e.thread}", []).append((start, end, e.name))
            if e.name.startswith("aten::") and not _inside_comm(e):
                compute.append((start, end))
    comm = merged([(s, e) for spans in comm_lanes.values() for s, e, _ in spans])
    busy = merged(compute)
    comm_us = length(comm)
    exposed_us = uncovered(comm, busy)
    figures = {
        "prof_comm_time_s": comm_us / 1e6,
        "prof_exposed_comm_s": exposed_us / 1e6,
        "prof_compute_time_s": length(busy) / 1e6,
        "prof_overlap_fraction": 1 - exposed_us / comm_us if comm_us > 0 else 0.0,
    }
    return figures, timeline(step, figures, compute_lanes, comm_lanes)


def _inside_comm(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith((LAUNCH_PREFIX, *COMM_PREFIXES)):
            return True
        parent = parent.cpu_parent
    return False


def timeline(
    step: int,
    figures: dict[str, float],
    compute_lanes: dict[str, list[tuple[float, float, str]]],
    comm_lanes: dict[str, list[tuple[float, float, str]]],
) -> dict[str, Any]:
    """Compact: times in whole µs from the first span; names once, spans refer to them by index."""
    spans = [s for lanes in (compute_lanes, comm_lanes) for lane in lanes.values() for s in lane]
    origin = min((s for s, _, _ in spans), default=0.0)
    end = max((e for _, e, _ in spans), default=origin)
    names: dict[str, int] = {}
    lanes = []
    for kind, group in (("compute", compute_lanes), ("comm", comm_lanes)):
        for label, lane in sorted(group.items()):
            kept = sorted(sorted(lane, key=lambda s: s[1] - s[0], reverse=True)[:MAX_SPANS])
            lanes.append(
                {
                    "label": label,
                    "kind": kind,
                    "spans": [
                        [round(s - origin), max(1, round(e - s)), names.setdefault(name, len(names))]
                        for s, e, name in kept
                    ],
                    "dropped": len(lane) - len(kept),
                }
            )
    return {"step": step, "duration_us": round(end - origin), "names": list(names), "lanes": lanes, "figures": figures}
