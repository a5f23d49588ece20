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

from backend import bundles, lifecycle, nodes, runs
from backend.db import transaction
from backend.models import Allocation, Attempt, Node, Run, utcnow
from torchyard import streams
from torchyard.settings import Settings, get_settings
from torchyard.spec import RunSpec

log = logging.getLogger(__name__)
REDISPATCH_AFTER_S = 30.0


@dataclass(frozen=True)
class Placement:
    run_id: int
    attempt: int
    node_id: str
    spec: dict


def place_queued_runs(session: Session) -> list[Placement]:
    alive = {n.id: n for n in session.scalars(select(Node).where(Node.status == "alive"))}
    free = nodes.free_slots(session)
    queued = session.scalars(
        select(Run)
        .where(Run.status.in_((lifecycle.QUEUED, lifecycle.RESTARTING)))
        .order_by(Run.priority.desc(), Run.created_at, Run.id)
    ).all()
    placements = []
    for run in queued:
        spec = RunSpec.model_validate(run.spec)
        need, device = spec.resources.procs_per_node, spec.resources.device
        fitting = [n for n in alive.values() if device in n.devices.split(",") and free.get(n.id, 0) >= need]
        if not fitting:
            reason = _why_unplaced(list(alive.values()), free, need, device)
            if run.status_reason != reason:
                run.status_reason = reason
            continue
        node = min(fitting, key=lambda n: (free[n.id], n.id))  # best fit keeps big holes for big runs
        number = len(run.attempts) + 1
        attempt = Attempt(number=number, status=lifecycle.SCHEDULED)
        run.attempts.append(attempt)  # through the relationship, so run.attempts stays true
        session.flush()
        session.add(Allocation(attempt_id=attempt.id, node_id=node.id, node_rank=0, slots=need))
        free[node.id] -= need
        lifecycle.transition(session, run, lifecycle.SCHEDULED, f"placed on {node.id} (attempt {number})")
        placements.append(Placement(run.id, number, node.id, run.spec))
    return placements


def _why_unplaced(alive: list[Node], free: dict[str, int], need: int, device: str) -> str:
    if not alive:
        return "waiting: no worker node is alive"
    with_device = [n for n in alive if device in n.devices.split(",")]
    if not with_device:
        return f"waiting: no alive node has device {device!r}"
    biggest = max(with_device, key=lambda n: n.slots)
    if biggest.slots < need:
        return f"waiting: needs {need} slots on one node; the largest node ({biggest.id}) has {biggest.slots}"
    best = max(with_device, key=lambda n: free.get(n.id, 0))
    return f"waiting: needs {need} free slots on one node; most free is {free.get(best.id, 0)} on {best.id}"


def fail_runs_on_lost_nodes(session: Session, lost: list[Node], timeout_s: float) -> None:
    lost_ids = {n.id for n in lost}
    for alloc, run in nodes.active_allocations(session):
        if alloc.node_id in lost_ids:
            attempt = alloc.attempt
            attempt.status, attempt.ended_at = lifecycle.FAILED, utcnow()
            runs.fail_or_restart(session, run, f"node {alloc.node_id} lost: no heartbeat for {timeout_s:.0f}s")


def unclaimed_placements(session: Session, client: redis.Redis, older_than_s: float) -> list[Placement]:
    """Placements no worker has claimed for a while: the message was lost (e.g. the api died
    between commit and send, or Redis restarted without it). Sending again is safe: a worker
    that finds the attempt already claimed does nothing."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    rows = session.execute(
        select(Attempt, Allocation.node_id)
        .join(Allocation, Allocation.attempt_id == Attempt.id)
        .join(Run, Attempt.run_id == Run.id)
        .where(Attempt.status == lifecycle.SCHEDULED, Attempt.created_at < cutoff, Run.status == lifecycle.SCHEDULED)
    ).all()
    return [
        Placement(attempt.run_id, attempt.number, node_id, attempt.run.spec)
        for attempt, node_id in rows
        if not client.exists(streams.attempt_claim_key(attempt.run_id, attempt.number))
    ]


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
        app.send_task(RUN_ATTEMPT_TASK, args=args, queue=node_queue(p.node_id))
        log.info("dispatched run %s attempt %s to %s", p.run_id, p.attempt, p.node_id)


def schedule_once(client: redis.Redis, settings: Settings) -> list[Placement]:
    with transaction() as session:
        lost = nodes.sync_from_heartbeats(session, client)
        if lost:
            fail_runs_on_lost_nodes(session, lost, settings.node_timeout_s)
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
