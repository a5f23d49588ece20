"""Sampled detail: every ``training.profile_every`` steps one step runs under ``torch.profiler``,
and the trace gives an independent measure of the step's communication:

- **comm intervals**: the collectives themselves. On Gloo they run on Gloo's own threads as
  ``gloo:<op>`` spans; on CUDA they are the NCCL kernels on the device.
- **compute intervals**: on CPU, every ``aten::`` op (forward, backward, optimizer) except those
  inside a collective or its launch (``c10d::*``); on CUDA every other device kernel. The
  timeline's compute lanes draw exactly these (the outermost of nested ops), so the picture and
  the overlap figure agree.
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

from workers.runtime.comm import length, merged, uncovered

COMM_PREFIXES = ("gloo:", "nccl:")
COPY_PREFIXES = ("Memcpy", "Memset")  # CUDA copy/set activities as the profiler names them
LAUNCH_PREFIX = "c10d::"  # the training thread's side of a collective: a launch (or a wait), not compute
MAX_SPANS = 300


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
    copy_lanes: dict[str, list[tuple[float, float, str]]] = {}
    if cuda:
        for e in events:
            if e.device_type != DeviceType.CUDA:
                continue
            start, end = _span(e)
            lane = f"cuda:{e.device_index} stream {getattr(e, 'device_resource_id', None)}"  # a lane per stream
            if "nccl" in e.name.lower():
                comm_lanes.setdefault(lane, []).append((start, end, e.name[:60]))
            elif e.name.startswith(COPY_PREFIXES):  # host<->device traffic: neither compute nor comm
                copy_lanes.setdefault(lane, []).append((start, end, e.name[:60]))
            else:
                compute_lanes.setdefault(lane, []).append((start, end, e.name[:60]))
                compute.append((start, end))
    else:
        for e in events:
            start, end = _span(e)
            if e.name.startswith(COMM_PREFIXES):  # Gloo's threads; send/recv on the caller's own
                comm_lanes.setdefault(f"thread {e.thread}", []).append((start, end, e.name))
            elif e.name.startswith("aten::") and not _inside(e, (LAUNCH_PREFIX, *COMM_PREFIXES)):
                compute.append((start, end))
                # The lane draws what the figures count: the outermost such ops (their union is the
                # compute above), not the enclosing autograd/DDP spans that also cover the waits.
                if not _inside(e, ("aten::",)):
                    compute_lanes.setdefault(f"thread {e.thread}", []).append((start, end, e.name))
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
    return figures, timeline(step, figures, {"compute": compute_lanes, "comm": comm_lanes, "copy": copy_lanes})


def _inside(event: Any, prefixes: tuple[str, ...]) -> bool:
    """Whether an enclosing op's name starts with one of ``prefixes``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefixes):
            return True
        parent = parent.cpu_parent
    return False


def timeline(
    step: int, figures: dict[str, float], by_kind: dict[str, dict[str, list[tuple[float, float, str]]]]
) -> dict[str, Any]:
    """Compact: times in whole µs from the first span; names once, spans refer to them by index.
    ``by_kind``: "compute" / "comm" / "copy" → lane label → spans."""
    spans = [s for lanes in by_kind.values() for lane in lanes.values() for s in lane]
    origin = min((s for s, _, _ in spans), default=0.0)
    end = max((e for _, e, _ in spans), default=origin)
    names: dict[str, int] = {}
    lanes = []
    for kind, group in by_kind.items():
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
