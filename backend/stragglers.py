"""Stragglers: the rank the others wait for, and why.

Every rank logs, per step, where its time went (``data_time_s``, ``compute_time_s`` and
``exposed_comm_s`` add up to ``step_time_s``; data includes the copy to the device) and when it
reached the step's first collective (``first_comm_at_s``, from its step's start). Steps start
together (each begins as the last one's collectives release every rank), so a rank that arrives
late holds the others in that collective: its lateness is their exposed comm. Over a window of
steps, each rank's figures are its medians (a GC pause, a checkpoint or a sampled step does not
move them), set against the median of the *other* ranks (with two ranks, the other one):

- ``late_s``: its arrival after theirs, or its data + compute over theirs where that is more
  (work after the step's collectives delays the next step's start, not this step's arrival);
- ``others_wait_s``: their exposed comm over its own: how long they wait for it;
- ``extra_data_s``, ``extra_compute_s``: its data and compute over theirs; the larger is the cause.

A rank is a straggler when both ``late_s`` and ``others_wait_s`` pass the threshold (late but
not waited for is no straggler: nobody was held up). Named for strategies whose every step ends in
collectives of every rank (DDP, ZeRO, FSDP, a script's); a pipeline's stages wait for each other by
design, and local SGD's ranks wait only at its averaging steps, which a median does not see."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.models import Metric, Run
from torchyard.spec import RunSpec, ScriptConfig

PARTS = ("step_time_s", "data_time_s", "compute_time_s", "exposed_comm_s", "first_comm_at_s")
DEFAULT_WINDOW = 100  # steps: the newest, by default
MAX_WINDOW = 2000  # steps one read may cover: at 64 ranks, 640,000 rows at most
# Below this, a rank's lateness is noise, not a rank to fix: Gloo's latency floor is ~1.5-2 ms per
# collective here, and ranks sharing a machine's cores jitter by a few ms a step.
NOISE_FLOOR_S = 0.005
# A rank that costs the others less than this share of their step is not worth naming: long steps
# (a GPU's) jitter by a few percent.
STEP_SHARE = 0.1
NOT_ATTRIBUTED = {
    "pipeline": "pipeline stages wait for each other by design (the bubble): no straggler is named",
    "local_sgd": "local SGD's ranks wait only at its averaging steps: no straggler is named",
    "async": "the parameter server's workers do not wait for each other (only within the staleness bound): no "
    "straggler is named",
}
WAITS_IN = {"ddp": "all-reduce", "zero": "all-reduce and broadcast", "fsdp": "all-gather and reduce-scatter"}


@dataclass(frozen=True, slots=True)
class RankTimes:
    """One rank's medians over the window (None: not logged)."""

    rank: int
    steps: int
    step_time_s: float | None = None
    data_time_s: float | None = None
    compute_time_s: float | None = None
    exposed_comm_s: float | None = None
    first_comm_at_s: float | None = None


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    cause: str  # data | compute
    late_s: float
    extra_data_s: float
    extra_compute_s: float
    others_wait_s: float
    text: str


def threshold(ranks: list[RankTimes]) -> float:
    """How late, and how long waited for, a rank must be to be named (seconds per step)."""
    step = _median([r.step_time_s for r in ranks])
    return max(NOISE_FLOOR_S, STEP_SHARE * step) if step is not None else NOISE_FLOOR_S


def attribute(ranks: list[RankTimes], waits_in: str = "all-reduce") -> list[Straggler]:
    """The ranks the others wait for, the latest first; none in a balanced run."""
    if len(ranks) < 2:
        return []
    limit = threshold(ranks)
    found = []
    for me in ranks:
        others = [r for r in ranks if r is not me]

        def over(part: str, me: RankTimes = me, others: list[RankTimes] = others) -> float | None:
            mine, theirs = getattr(me, part), _median([getattr(r, part) for r in others])
            return None if mine is None or theirs is None else mine - theirs

        extra_data, extra_compute = over("data_time_s") or 0.0, over("compute_time_s") or 0.0
        busy, arrival = extra_data + extra_compute, over("first_comm_at_s")
        # Arrival counts from the rank's own step start: work after the step's collectives (the
        # optimizer step; everything, on a throttled host) delays its next start instead, which
        # only its extra busy time shows. The larger of the two is how late it is.
        late = busy if arrival is None else max(arrival, busy)
        waited = over("exposed_comm_s")
        others_wait = -waited if waited is not None else 0.0
        if late < limit or others_wait < limit:
            continue
        cause = "data" if extra_data >= extra_compute else "compute"
        what = "data loading" if cause == "data" else "compute"
        extra = extra_data if cause == "data" else extra_compute
        text = (
            f"rank {me.rank}: {what} {_ms(extra, signed=True)}/step, others wait {_ms(others_wait)}/step in {waits_in}"
        )
        found.append(Straggler(me.rank, cause, late, extra_data, extra_compute, others_wait, text))
    return sorted(found, key=lambda s: -s.late_s)


def window(session: Session, run: Run, steps: int = DEFAULT_WINDOW, step_max: int | None = None) -> dict[str, Any]:
    """The attribution over the ``steps`` steps up to ``step_max`` (default: the run's last), with
    every rank's medians: what ``GET /runs/{id}/stragglers`` answers."""
    hi = run.last_step if step_max is None else min(step_max, run.last_step)
    lo = max(1, hi - steps + 1)
    ranks = rank_times(session, run.id, lo, hi)
    spec = run.run_spec
    limit = threshold(ranks) if ranks else None
    excuse = NOT_ATTRIBUTED.get(spec.strategy.kind)
    found = [] if excuse else attribute(ranks, _waits_in(spec))
    if found:
        headline = "; ".join(s.text for s in found[:3]) + (f"; {len(found) - 3} more" if len(found) > 3 else "")
    elif excuse:
        headline = excuse
    elif not ranks:
        headline = "no step times yet"
    elif len(ranks) < 2:
        headline = "one rank: nobody waits for another"
    else:
        headline = f"balanced: no rank keeps the others waiting {_ms(limit or 0)}/step or more (steps {lo:,}–{hi:,})"
    return {
        "run_id": run.id,
        "step_min": lo,
        "step_max": hi,
        "threshold_s": limit,
        "headline": headline,
        "stragglers": found,
        "ranks": ranks,
    }


def rank_times(session: Session, run_id: int, lo: int, hi: int) -> list[RankTimes]:
    """Each rank's medians of :data:`PARTS` over steps ``lo``..``hi`` (the newest attempt's value where
    a resumed attempt logged a step again, as the charts show)."""
    rows = (
        session.connection()
        .execute(  # Core rows: no ORM bookkeeping for tens of thousands of them
            select(Metric.rank, Metric.key, Metric.step, Metric.value)
            .where(Metric.run_id == run_id, Metric.key.in_(PARTS), Metric.step >= lo, Metric.step <= hi)
            .order_by(Metric.rank, Metric.key, Metric.step, Metric.attempt)
        )
        .all()
    )
    latest: dict[tuple[int, str, int], float | None] = {}
    for rank, key, step, value in rows:  # ordered by attempt: a later one overwrites
        latest[(rank, key, step)] = value
    values: dict[int, dict[str, list[float]]] = {}
    for (rank, key, _step), value in latest.items():
        if value is not None:
            values.setdefault(rank, {}).setdefault(key, []).append(value)
    return [
        RankTimes(
            rank=rank,
            steps=len(parts.get("step_time_s", [])),
            **{key: float(np.median(parts[key])) for key in PARTS if parts.get(key)},
        )
        for rank, parts in sorted(values.items())
    ]


def _waits_in(spec: RunSpec) -> str:
    if isinstance(spec.workload, ScriptConfig):
        return "its collectives"
    return WAITS_IN.get(spec.strategy.kind, "collectives")


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


def _ms(seconds: float, signed: bool = False) -> str:
    return f"{seconds * 1e3:{'+' if signed else ''}.0f} ms"
