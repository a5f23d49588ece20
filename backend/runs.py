"""The runs data layer: queries and changes; flushes, never commits (the caller owns the
transaction)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from backend import lifecycle
from backend.models import Attempt, LogLine, Node, Run, RunEvent, StepProfile, Token
from torchyard.spec import RunSpec


class NotFound(Exception):
    pass


class InvalidRequest(Exception):
    """A request that is well-formed but cannot be met (e.g. a device no node has): a 422."""

    def __init__(self, loc: list[str | int], msg: str, value: object) -> None:
        super().__init__(msg)
        self.loc, self.msg, self.value = loc, msg, value


class LimitExceeded(Exception):
    """A quota the caller has used up: a 429 saying which and how to get under it."""


def get_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} not found")
    return run


def create_run(session: Session, spec: RunSpec, owner: Token | None, max_in_flight: int | None = None) -> Run:
    _check_cluster_has_device(session, spec.resources.device)
    if owner is not None and max_in_flight is not None:
        in_flight = session.scalar(
            select(func.count()).where(Run.owner_id == owner.id, Run.status.not_in(lifecycle.TERMINAL))
        )
        if (in_flight or 0) >= max_in_flight:
            raise LimitExceeded(
                f"token {owner.name!r} has {in_flight} unfinished runs, the most allowed "
                f"(TORCHYARD_MAX_RUNS_IN_FLIGHT={max_in_flight}): wait for one to end or cancel one"
            )
    run = Run(
        name=spec.name,
        status=lifecycle.QUEUED,
        status_reason="waiting for the scheduler",
        spec=spec.model_dump(mode="json"),
        priority=spec.resources.priority,
        owner_id=owner.id if owner else None,
    )
    session.add(run)
    session.flush()
    session.add(RunEvent(run_id=run.id, from_status=None, to_status=lifecycle.QUEUED, reason="submitted"))
    return run


def _check_cluster_has_device(session: Session, device: str) -> None:
    if device == "cpu":
        return  # every node has a CPU; with no node yet, the run waits for one
    nodes = session.scalars(select(Node)).all()
    if not any(device in n.devices.split(",") for n in nodes):
        known = ", ".join(f"{n.id} ({n.devices})" for n in nodes) or "no nodes have registered"
        raise InvalidRequest(
            ["body", "resources", "device"], f"no node in the cluster has device {device!r}: {known}", device
        )


def list_runs(
    session: Session, status: str | None, name: str | None, limit: int, offset: int
) -> tuple[Sequence[Run], int]:
    query = select(Run)
    if status:
        query = query.where(Run.status.in_(status.split(",")))
    if name:
        query = query.where(Run.name.contains(name, autoescape=True))
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    page = query.order_by(Run.id.desc()).limit(limit).offset(offset)
    # The page's attempts and allocations in two more queries, not two per run.
    rows = session.scalars(page.options(selectinload(Run.attempts).selectinload(Attempt.allocations))).all()
    return rows, total


def list_events(session: Session, run_id: int) -> Sequence[RunEvent]:
    return session.scalars(select(RunEvent).where(RunEvent.run_id == run_id).order_by(RunEvent.id)).all()


def list_logs(session: Session, run_id: int, rank: int | None, after_id: int, limit: int) -> Sequence[LogLine]:
    query = select(LogLine).where(LogLine.run_id == run_id, LogLine.id > after_id)
    if rank is not None:
        query = query.where(LogLine.rank == rank)
    return session.scalars(query.order_by(LogLine.id).limit(limit)).all()


def profiled_steps(session: Session, run_id: int) -> list[dict[str, Any]]:
    """The sampled steps, newest first, each with the latest attempt that sampled it and its ranks."""
    rows = session.execute(
        select(StepProfile.step, StepProfile.attempt, StepProfile.rank)
        .where(StepProfile.run_id == run_id)
        .order_by(StepProfile.step.desc(), StepProfile.attempt.desc(), StepProfile.rank)
    ).all()
    out: list[dict[str, Any]] = []
    for step, attempt, rank in rows:
        if not out or out[-1]["step"] != step:
            out.append({"step": step, "attempt": attempt, "ranks": []})
        if out[-1]["attempt"] == attempt:
            out[-1]["ranks"].append(rank)
    return out


def step_timelines(session: Session, run_id: int, step: int) -> dict[str, Any]:
    """Every rank's timeline of a sampled step (the latest attempt's)."""
    rows = session.execute(
        select(StepProfile.attempt, StepProfile.rank, StepProfile.timeline)
        .where(StepProfile.run_id == run_id, StepProfile.step == step)
        .order_by(StepProfile.attempt.desc(), StepProfile.rank)
    ).all()
    if not rows:
        sampled = [s["step"] for s in profiled_steps(session, run_id)[:5]]
        raise NotFound(
            f"run {run_id} has no sampled step {step}"
            + (f" (latest sampled: {', '.join(map(str, sampled))})" if sampled else " (training.profile_every is 0?)")
        )
    attempt = rows[0][0]
    ranks = {str(rank): json.loads(timeline) for a, rank, timeline in rows if a == attempt}
    return {"step": step, "attempt": attempt, "ranks": ranks}


def latest_attempt(session: Session, run_id: int) -> Attempt | None:
    return session.scalar(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number.desc()).limit(1))


def fail_or_restart(session: Session, run: Run, reason: str) -> None:
    """The run's node failed it (lost, or its worker restarted), not its own code: a new attempt
    resumes from the last checkpoint while the run has attempts left."""
    if run.status == lifecycle.CANCELLING:
        lifecycle.transition(session, run, lifecycle.CANCELLED, reason)
        return
    allowed = int(run.spec.get("training", {}).get("max_attempts", 1))
    used = len(run.attempts)
    if used < allowed and lifecycle.can_transition(run, lifecycle.RESTARTING):
        lifecycle.transition(
            session,
            run,
            lifecycle.RESTARTING,
            f"{reason}; restarting from the last checkpoint (attempt {used + 1} of {allowed})",
        )
    elif lifecycle.can_transition(run, lifecycle.FAILED):
        lifecycle.transition(
            session, run, lifecycle.FAILED, f"{reason} (attempt {used} of {allowed}: no attempts left)"
        )


def request_cancel(session: Session, run: Run, reason: str) -> None:
    """queued runs are cancelled at once; placed ones go to ``cancelling`` until the worker has
    ended every process (it reports the exit, and ingest records ``cancelled``)."""
    if run.status in (lifecycle.QUEUED, lifecycle.RESTARTING):
        lifecycle.transition(session, run, lifecycle.CANCELLED, reason)
    else:
        lifecycle.transition(session, run, lifecycle.CANCELLING, reason)
