"""The sweeps data layer: queries and changes; flushes, never commits (the caller owns the
transaction). The controller that runs a sweep is ``backend/sweeper.py``."""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from backend import runs
from backend.errors import Conflict, NotFound
from backend.models import Metric, Run, Sweep, SweepTrial, Token, utcnow
from backend.sweep_spec import Objective, SweepSpec
from torchyard.states import TERMINAL, SweepState, TrialState


def create_sweep(session: Session, spec: SweepSpec, owner: Token) -> Sweep:
    name = spec.name or spec.base.name or spec.base.default_name
    sweep = Sweep(
        name=name,
        status=SweepState.RUNNING,
        status_reason="waiting for the controller",
        spec=spec.model_copy(update={"name": name}).model_dump(mode="json"),
        owner_id=owner.id,
    )
    session.add(sweep)
    session.flush()
    return sweep


def get_sweep(session: Session, sweep_id: int) -> Sweep:
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise NotFound(f"sweep {sweep_id} not found")
    return sweep


def list_sweeps(session: Session, limit: int, offset: int) -> tuple[Sequence[Sweep], int]:
    total = session.scalar(select(func.count()).select_from(Sweep)) or 0
    rows = session.scalars(
        select(Sweep).options(selectinload(Sweep.trials)).order_by(Sweep.id.desc()).limit(limit).offset(offset)
    ).all()
    return rows, total


def cancel_sweep(session: Session, sweep: Sweep, reason: str) -> list[int]:
    """No trial starts after this; every unfinished run of it is asked to stop (the controller
    tells Optuna as their trials end). Returns the runs whose workers must be told. An ended sweep
    cannot be cancelled (409)."""
    if sweep.status != SweepState.RUNNING:
        raise Conflict(f"sweep {sweep.id} is {sweep.status}; it cannot be cancelled")
    sweep.status, sweep.status_reason, sweep.ended_at = SweepState.CANCELLED, reason, utcnow()
    stopping = []
    for trial in sweep.trials:
        run = trial.run
        if run is not None and run.status not in TERMINAL:
            runs.request_cancel(session, run, f"{reason} (sweep {sweep.id})")
            stopping.append(run.id)
    session.flush()
    return stopping


def in_flight(sweep: Sweep) -> int:
    """Trials holding a place under max_concurrent: those whose run is unfinished (a pruned trial's
    run too, until its processes have ended)."""
    return sum(1 for t in sweep.trials if t.run is not None and t.run.status not in TERMINAL)


def step_values(
    session: Session, run: Run, key: str, after_step: int, complete_only: bool
) -> list[tuple[int, float | None]]:
    """The run's ``key`` by step after ``after_step``: the mean over ranks of the newest attempt that
    logged the step (None: every rank logged NaN). ``complete_only``: stop before the first step
    not every rank has logged yet (ingest writes ranks' points as they come)."""
    rows = session.execute(
        select(Metric.step, Metric.attempt, func.avg(Metric.value), func.count())
        .where(Metric.run_id == run.id, Metric.key == key, Metric.step > after_step)
        .group_by(Metric.step, Metric.attempt)
        .order_by(Metric.step, Metric.attempt)
    ).all()
    newest: dict[int, tuple[float | None, int]] = {}
    for step, _attempt, mean, count in rows:
        newest[int(step)] = (None if mean is None else float(mean), int(count))
    world = run.run_spec.world_size
    out = []
    for step in sorted(newest):
        mean, count = newest[step]
        if complete_only and count < world:
            break
        out.append((step, mean))
    return out


def objective_value(points: list[tuple[int, float | None]], objective: Objective) -> float | None:
    """A finished run's value: its last step's, its best step's, or the mean of its last k steps'
    (None when there is none, or it is NaN)."""
    values = [v for _, v in points]
    if not values:
        return None
    if objective.take == "best":
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if not finite:
            return None
        return min(finite) if objective.direction == "minimize" else max(finite)
    tail = values[-objective.k :] if objective.take == "mean_last_k" else values[-1:]
    if any(v is None or not math.isfinite(v) for v in tail):
        return None
    return sum(v for v in tail if v is not None) / len(tail)


def best_trial(sweep: Sweep, objective: Objective) -> SweepTrial | None:
    done = [t for t in sweep.trials if t.state == TrialState.COMPLETE and t.value is not None]
    if not done:
        return None
    sign = 1 if objective.direction == "minimize" else -1
    return min(done, key=lambda t: (sign * (t.value or 0.0), t.number))
