"""The runs data layer: queries and changes; flushes, never commits (the caller owns the
transaction)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from backend import admission, errors, executors, lifecycle, nodes
from backend.errors import NotFound
from backend.models import Attempt, LogLine, Node, Run, RunEvent, StepProfile, Token
from torchyard.settings import get_settings
from torchyard.spec import ResourcesConfig, RunSpec
from torchyard.states import TERMINAL, NodeState


def get_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} not found")
    return run


def create_run(
    session: Session,
    spec: RunSpec,
    owner: Token | None,
    max_in_flight: int | None = None,
    max_member_priority: int | None = None,
    allow_waiting_for_nodes: bool = False,
) -> Run:
    warnings = check_cluster_can_hold(session, spec.resources, allow_waiting_for_nodes)
    admission.check_priority(spec.resources.priority, owner, max_member_priority)
    if owner is not None and max_in_flight is not None:
        in_flight = unfinished_count(session, owner)
        if in_flight >= max_in_flight:
            raise errors.LimitExceeded(
                f"token {owner.name!r} has {in_flight} unfinished runs, the most allowed "
                f"(TORCHYARD_MAX_RUNS_IN_FLIGHT={max_in_flight}): wait for one to end or cancel one"
            )
    # Said at once (`submit --follow` prints it); the scheduler's next pass says more.
    if warnings:
        reason = f"waiting: {warnings[0]}"
    elif (pool := get_settings().pool(spec.resources.pool)).executor == "slurm":
        reason = f"waiting to be submitted to Slurm pool {pool.name}"
    elif not session.scalar(select(func.count()).select_from(Node).where(Node.status == NodeState.ALIVE)):
        reason = f"waiting: {nodes.NONE_ALIVE}"
    else:
        reason = "waiting for the scheduler"
    name = spec.name or spec.default_name
    run = Run(
        name=name,
        status=lifecycle.QUEUED,
        status_reason=reason,
        spec=spec.model_copy(update={"name": name}).model_dump(mode="json"),
        priority=spec.resources.priority,
        owner_id=owner.id if owner else None,
        warnings=warnings,
    )
    session.add(run)
    session.flush()
    submitted = "submitted" + "".join(f"; warning: {w}" for w in warnings)
    session.add(RunEvent(run_id=run.id, from_status=None, to_status=lifecycle.QUEUED, reason=submitted))
    return run


def unfinished_count(session: Session, owner: Token) -> int:
    """The owner's runs that have not ended: what TORCHYARD_MAX_RUNS_IN_FLIGHT bounds."""
    return session.scalar(select(func.count()).where(Run.owner_id == owner.id, Run.status.not_in(TERMINAL))) or 0


def check_cluster_can_hold(session: Session, res: ResourcesConfig, allow_waiting: bool) -> list[str]:
    """The run's pool (``resources.pool``; a 422 naming it when there is none) can ever hold it: the
    built-in workers' registered nodes (``nodes.check_can_hold``), or a Slurm pool's partition
    (``slurm_pools.check_resources``). A 422 naming the field when not; warnings when the run must wait."""
    settings = get_settings()
    pool = executors.pool_for(settings, res)
    return executors.executor_for(pool, settings).check(session, res, allow_waiting)


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


def list_logs(
    session: Session,
    run_id: int,
    rank: int | None,
    after_id: int,
    limit: int,
    before_id: int | None = None,
    contains: str | None = None,
) -> Sequence[LogLine]:
    """Up to ``limit`` lines in id order: the first after ``after_id``, or with ``before_id`` the
    last before it (paging back from the end of the log, where a failure's traceback is); only
    ``rank``'s, only those holding the text ``contains`` (any case), when given."""
    query = select(LogLine).where(LogLine.run_id == run_id, LogLine.id > after_id)
    if rank is not None:
        query = query.where(LogLine.rank == rank)
    if contains:
        query = query.where(LogLine.text.icontains(contains, autoescape=True))
    if before_id is None:
        return session.scalars(query.order_by(LogLine.id).limit(limit)).all()
    newest_first = session.scalars(query.where(LogLine.id < before_id).order_by(LogLine.id.desc()).limit(limit)).all()
    return newest_first[::-1]


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


def request_cancel(session: Session, run: Run, reason: str) -> None:
    """queued runs are cancelled at once; placed ones go to ``cancelling`` until the worker has
    ended every process (it reports the exit, and ``attempts`` records ``cancelled``). Asking
    again while it is cancelling changes nothing; an ended run cannot be cancelled (409)."""
    if run.status == lifecycle.CANCELLING:
        return
    if run.status in (lifecycle.QUEUED, lifecycle.RESTARTING):
        lifecycle.transition(session, run, lifecycle.CANCELLED, reason)
    else:
        lifecycle.transition(session, run, lifecycle.CANCELLING, reason)
