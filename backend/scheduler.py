"""The scheduler: one leader at a time (a Redis lock) places queued runs on nodes with free
slots, by priority then age, and notices lost nodes. Celery carries each placement to the
node's queue only after the placement has committed."""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend import bundles, lifecycle, nodes, runs, watchdog
from backend.db import transaction
from backend.models import Allocation, Attempt, Node, Run, utcnow
from torchyard import streams
from torchyard.settings import Settings, get_settings
from torchyard.spec import RunSpec

log = logging.getLogger(__name__)
REDISPATCH_AFTER_S = 30.0


@dataclass(frozen=True)
class Placement:
    """One node's share of an attempt. A gang of N nodes is N placements made in one pass."""

    run_id: int
    attempt: int
    node_id: str
    spec: dict
    node_rank: int = 0
    nnodes: int = 1
    rdzv_host: str = ""  # the advertised address of node rank 0: the c10d rendezvous lives there


def place_queued_runs(session: Session) -> list[Placement]:
    """Places waiting runs by priority, then age. A run of N nodes gets N nodes in this one
    transaction or none (gang placement: never a partial allocation, so no two gangs can hold
    half of each other's nodes). Policy: reservations. The first run that cannot be placed
    reserves the slots it needs on the nodes that will fit it soonest; runs behind it may only
    use slots nobody reserved, so small runs fill gaps without starving a waiting larger run."""
    alive = {n.id: n for n in session.scalars(select(Node).where(Node.status == "alive").order_by(Node.id))}
    free = nodes.free_slots(session)
    reserved: dict[str, int] = {}
    queued = session.scalars(
        select(Run)
        .where(Run.status.in_((lifecycle.QUEUED, lifecycle.RESTARTING)))
        .order_by(Run.priority.desc(), Run.created_at, Run.id)
    ).all()
    placements: list[Placement] = []
    for run in queued:
        res = RunSpec.model_validate(run.spec).resources
        need, count = res.procs_per_node, res.nodes
        capable = [n for n in alive.values() if res.device in n.devices.split(",") and n.slots >= need]
        usable = [n for n in capable if free.get(n.id, 0) - reserved.get(n.id, 0) >= need]
        if len(usable) < count:
            reason = _why_unplaced(list(alive.values()), free, reserved, need, count, res.device)
            if len(capable) >= count:  # it will fit once slots free up: hold them against smaller runs
                soonest = sorted(capable, key=lambda n: (-(free.get(n.id, 0) - reserved.get(n.id, 0)), n.id))
                for node in soonest[:count]:
                    reserved[node.id] = reserved.get(node.id, 0) + need
                reason += f"; holding {need} slots on {', '.join(n.id for n in soonest[:count])} for it"
            if run.status_reason != reason:
                run.status_reason = reason
            continue
        # Best fit: the tightest nodes first keeps big holes for big runs.
        gang = sorted(usable, key=lambda n: (free[n.id] - reserved.get(n.id, 0), n.id))[:count]
        number = len(run.attempts) + 1
        attempt = Attempt(number=number, status=lifecycle.SCHEDULED)
        run.attempts.append(attempt)  # through the relationship, so run.attempts stays true
        session.flush()
        for node_rank, node in enumerate(gang):
            session.add(Allocation(attempt_id=attempt.id, node_id=node.id, node_rank=node_rank, slots=need))
            free[node.id] -= need
            placements.append(Placement(run.id, number, node.id, run.spec, node_rank, count, gang[0].host))
        where = gang[0].id if count == 1 else f"{count} nodes ({', '.join(n.id for n in gang)})"
        lifecycle.transition(session, run, lifecycle.SCHEDULED, f"placed on {where} (attempt {number})")
    return placements


def _why_unplaced(
    alive: list[Node], free: dict[str, int], reserved: dict[str, int], need: int, count: int, device: str
) -> str:
    if not alive:
        return "waiting: no worker node is alive"
    with_device = [n for n in alive if device in n.devices.split(",")]
    if not with_device:
        return f"waiting: no alive node has device {device!r}"
    big_enough = [n for n in with_device if n.slots >= need]
    per_node = f"{need} slots on each of {count} nodes" if count > 1 else f"{need} slots on one node"
    if len(big_enough) < count:
        largest = max(with_device, key=lambda n: n.slots)
        return (
            f"waiting: needs {per_node}; {len(big_enough)} alive node(s) have that many "
            f"(the largest, {largest.id}, has {largest.slots})"
        )
    ready = sorted(n.id for n in big_enough if free.get(n.id, 0) - reserved.get(n.id, 0) >= need)
    held = sum(1 for n in big_enough if reserved.get(n.id, 0))
    detail = f"{len(ready)} node(s) have them free now" + (f" ({', '.join(ready)})" if ready else "")
    if held:
        detail += f"; {held} node(s) hold slots for an earlier waiting run"
    return f"waiting: needs {per_node} free at once; {detail}"


def fail_runs_on_lost_nodes(session: Session, lost: list[Node], timeout_s: float) -> None:
    lost_ids = {n.id for n in lost}
    for alloc, run in nodes.active_allocations(session):
        if alloc.node_id not in lost_ids:
            continue
        alloc.exit_status, alloc.ended_at = "lost", utcnow()  # the node is gone: it holds nothing
        attempt = alloc.attempt
        if attempt.ended_at is None and run.status in lifecycle.ACTIVE:
            lifecycle.end_attempt(session, attempt, lifecycle.FAILED)  # the rest of the gang stops too
            runs.fail_or_restart(session, run, f"node {alloc.node_id} lost: no heartbeat for {timeout_s:.0f}s")


def unclaimed_placements(session: Session, client: redis.Redis, older_than_s: float) -> list[Placement]:
    """Placements no worker has claimed for a while: the message was lost (e.g. the api died
    between commit and send, or Redis restarted without it). Sending again is safe: a worker
    that finds the attempt already claimed does nothing."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    rows = session.execute(
        select(Attempt, Allocation)
        .join(Allocation, Allocation.attempt_id == Attempt.id)
        .join(Run, Attempt.run_id == Run.id)
        .where(
            Attempt.ended_at.is_(None),
            Allocation.started_at.is_(None),  # a share that started is never sent twice
            Allocation.ended_at.is_(None),
            Attempt.created_at < cutoff,
            Run.status.in_((lifecycle.SCHEDULED, lifecycle.RUNNING)),  # one node of a gang may start late
        )
    ).all()
    return [
        placement_of(attempt, alloc)
        for attempt, alloc in rows
        if not client.exists(streams.attempt_claim_key(attempt.run_id, attempt.number, alloc.node_rank))
    ]


def placement_of(attempt: Attempt, alloc: Allocation) -> Placement:
    first = next(a for a in attempt.allocations if a.node_rank == 0)
    return Placement(
        attempt.run_id, attempt.number, alloc.node_id, attempt.run.spec,
        alloc.node_rank, len(attempt.allocations), first.node.host,
    )  # fmt: skip


def dispatch(client: redis.Redis, placements: list[Placement], settings: Settings | None = None) -> None:
    from workers.celery_app import RUN_ATTEMPT_TASK, app, node_queue

    settings = settings or get_settings()
    for p in placements:
        stream = streams.run_stream(p.run_id)
        try:
            client.xgroup_create(stream, streams.INGEST_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        client.sadd(streams.ACTIVE_STREAMS, stream)
        args: list[object] = [p.run_id, p.attempt, p.spec]
        workload = p.spec.get("workload", {})
        if workload.get("kind") == "script":  # the worker fetches the code with this, no token needed
            args.append(bundles.capability(settings, workload["bundle"]))
        gang = {"node_rank": p.node_rank, "nnodes": p.nnodes, "rdzv_host": p.rdzv_host}
        app.send_task(RUN_ATTEMPT_TASK, args=args, kwargs=gang, queue=node_queue(p.node_id))
        log.info("dispatched run %s attempt %s (node rank %s) to %s", p.run_id, p.attempt, p.node_rank, p.node_id)


def schedule_once(client: redis.Redis, settings: Settings) -> list[Placement]:
    with transaction() as session:
        lost = nodes.sync_from_heartbeats(session, client)
        if lost:
            fail_runs_on_lost_nodes(session, lost, settings.node_timeout_s)
        watchdog.stop_stalled_and_overdue(session)
        placements = place_queued_runs(session)
        lost_messages = unclaimed_placements(session, client, REDISPATCH_AFTER_S)
    for p in lost_messages:
        log.warning("run %s attempt %s was never claimed by %s: sending it again", p.run_id, p.attempt, p.node_id)
    dispatch(client, placements + lost_messages, settings)
    return placements


def serve(stop: threading.Event | None = None) -> None:
    """Runs passes until ``stop``; only the holder of the leader lock schedules."""
    settings = get_settings()
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=30)
    lifecycle.set_publisher(client)
    stop = stop or threading.Event()
    lock = client.lock(streams.SCHEDULER_LOCK, timeout=max(10.0, 5 * settings.scheduler_interval_s))
    name = uuid.uuid4().hex[:8]
    leader = False
    while not stop.is_set():
        try:
            leader = lock.reacquire() if leader else lock.acquire(blocking=False, token=name)
        except Exception:
            leader = False
        if leader:
            try:
                schedule_once(client, settings)
            except Exception:
                log.exception("scheduler pass failed; retrying")
        try:  # sleep until the interval passes or a submit wakes us
            client.blpop([streams.SCHEDULER_WAKE], timeout=settings.scheduler_interval_s)
        except redis.RedisError:
            stop.wait(settings.scheduler_interval_s)
