"""The scheduler: one leader at a time (a Redis lock) places queued runs on nodes with free
slots, by priority then age, and notices lost nodes. Celery carries each share to its
node's queue only after the share has committed."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from typing import Any

import redis
from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend import attempts, bundles, leader, lifecycle, nodes, watchdog
from backend.db import transaction
from backend.models import Allocation, Attempt, Node, Run, utcnow
from torchyard import streams
from torchyard.settings import Settings, get_settings
from torchyard.spec import RunSpec, ScriptConfig
from torchyard.states import ACTIVE, AttemptState, NodeState
from torchyard.tasks import RUN_ATTEMPT_TASK, make_celery, node_queue

log = logging.getLogger(__name__)
REDISPATCH_AFTER_S = 30.0


@dataclass(frozen=True)
class Share:
    """One node's share of an attempt, as its worker is sent it (plain data: it is dispatched after
    the transaction that made it commits). What it holds on the node (slots, or GPUs) is its
    ``Allocation`` row. A gang of N nodes is N shares made in one pass."""

    run_id: int
    attempt: int
    node_id: str
    spec: dict
    node_rank: int = 0
    nnodes: int = 1
    rdzv_host: str = ""  # the advertised address of node rank 0: the c10d rendezvous lives there
    gpus: tuple[int, ...] = ()  # a CUDA share's GPUs on its node (its ranks' CUDA_VISIBLE_DEVICES)


def place_queued_runs(session: Session) -> list[Share]:
    """Places waiting runs by priority, then age. A run of N nodes gets N nodes in this one
    transaction or none (gang placement: never a partial allocation, so no two gangs can hold
    half of each other's nodes). A CPU run counts CPU slots, a CUDA run GPUs (one process per GPU,
    the GPUs named: no two shares ever hold the same GPU). Policy: reservations. The first run that
    cannot be placed reserves what it needs on the nodes that will fit it soonest; runs behind it
    may only use what nobody reserved, so small runs fill gaps without starving a waiting larger run."""
    alive = list(session.scalars(select(Node).where(Node.status == NodeState.ALIVE).order_by(Node.id)))
    free = nodes.free_capacity(session)
    reserved: dict[tuple[str, str], int] = {}  # (device, node) -> slots or GPUs held for a waiting run
    queued = session.scalars(
        select(Run)
        .where(Run.status.in_((lifecycle.QUEUED, lifecycle.RESTARTING)))
        .order_by(Run.priority.desc(), Run.created_at, Run.id)
    ).all()
    shares: list[Share] = []
    settings = get_settings()
    for run in queued:
        res = run.run_spec.resources
        if not on_workers(settings, res.pool):
            continue  # a Slurm pool's run: Slurm places it (backend/slurm.py)
        need, count, device = res.procs_per_node, res.nodes, res.device
        capable = [n for n in alive if nodes.capacity(n, device) >= need]
        usable = [n for n in capable if _spare(n, device, free, reserved) >= need]
        if len(usable) < count:
            reason = _why_unplaced(session, alive, free, reserved, need, count, device)
            if len(capable) >= count:  # it will fit once they free up: hold them against smaller runs
                soonest = sorted(capable, key=lambda n: (-_spare(n, device, free, reserved), n.id))[:count]
                for node in soonest:
                    reserved[(device, node.id)] = reserved.get((device, node.id), 0) + need
                reason += f"; holding {need} {nodes.unit(device)} on {', '.join(n.id for n in soonest)} for it"
            if run.status_reason != reason:
                run.status_reason = reason
            continue
        # Best fit: the tightest nodes first keeps big holes for big runs.
        gang = sorted(usable, key=lambda n: (_spare(n, device, free, reserved), n.id))[:count]
        number = len(run.attempts) + 1
        attempt = Attempt(number=number, status=lifecycle.SCHEDULED)
        run.attempts.append(attempt)  # through the relationship, so run.attempts stays true
        session.flush()
        for node_rank, node in enumerate(gang):
            held = free[node.id]
            gpus = held.gpus[:need] if device == "cuda" else []
            slots = 0 if device == "cuda" else need
            held.slots, held.gpus = held.slots - slots, held.gpus[len(gpus) :]
            session.add(Allocation(attempt_id=attempt.id, node_id=node.id, node_rank=node_rank, slots=slots, gpus=gpus))
            shares.append(Share(run.id, number, node.id, run.spec, node_rank, count, gang[0].host, tuple(gpus)))
        where = gang[0].id if count == 1 else f"{count} nodes ({', '.join(n.id for n in gang)})"
        on_gpus = f", GPUs {_gpu_list(shares[-count:])}" if device == "cuda" else ""
        lifecycle.transition(session, run, lifecycle.SCHEDULED, f"placed on {where}{on_gpus} (attempt {number})")
    return shares


def on_workers(settings: Settings, pool: str | None) -> bool:
    """The run's pool is the built-in one (torchyard's workers), which this scheduler places."""
    try:
        return settings.pool(pool).executor == "workers"
    except KeyError:
        return False


def _gpu_list(gang: list[Share]) -> str:
    if len(gang) == 1:
        return ",".join(map(str, gang[0].gpus))
    return "; ".join(f"{s.node_id}: {','.join(map(str, s.gpus))}" for s in gang)


def _spare(node: Node, device: str, free: dict[str, nodes.Free], reserved: dict[tuple[str, str], int]) -> int:
    """What of ``device`` the node has free that no earlier waiting run holds."""
    return free[node.id].count(device) - reserved.get((device, node.id), 0)


def _why_unplaced(
    session: Session,
    alive: list[Node],
    free: dict[str, nodes.Free],
    reserved: dict[tuple[str, str], int],
    need: int,
    count: int,
    device: str,
) -> str:
    if not alive:
        return f"waiting: {nodes.NONE_ALIVE if session.scalar(select(Node.id).limit(1)) else nodes.NONE_REGISTERED}"
    with_device = [n for n in alive if nodes.offers(n, device)]
    if not with_device:
        return f"waiting: no alive node has device {device!r}"
    unit = nodes.unit(device)
    big_enough = [n for n in with_device if nodes.capacity(n, device) >= need]
    per_node = f"{need} {unit} on each of {count} nodes" if count > 1 else f"{need} {unit} on one node"
    if len(big_enough) < count:
        largest = max(with_device, key=lambda n: nodes.capacity(n, device))
        return (
            f"waiting: needs {per_node}; {len(big_enough)} alive node(s) have that many "
            f"(the largest, {largest.id}, has {nodes.capacity(largest, device)})"
        )
    ready = sorted(n.id for n in big_enough if _spare(n, device, free, reserved) >= need)
    held = sum(1 for n in big_enough if reserved.get((device, n.id), 0))
    detail = f"{len(ready)} node(s) have them free now" + (f" ({', '.join(ready)})" if ready else "")
    if held:
        detail += f"; {held} node(s) hold {unit} for an earlier waiting run"
    return f"waiting: needs {per_node} free at once; {detail}"


def fail_runs_on_lost_nodes(session: Session, lost: list[Node], timeout_s: float) -> None:
    lost_ids = {n.id for n in lost}
    for alloc, run in nodes.active_allocations(session):
        if alloc.node_id not in lost_ids:
            continue
        alloc.exit_status, alloc.ended_at = AttemptState.LOST, utcnow()  # the node is gone: it holds nothing
        attempt = alloc.attempt
        if attempt.ended_at is None and run.status in ACTIVE:
            attempts.end_attempt(session, attempt, lifecycle.FAILED)  # the rest of the gang stops too
            attempts.fail_or_restart(session, run, f"node {alloc.node_id} lost: no heartbeat for {timeout_s:.0f}s")


def unclaimed_shares(session: Session, client: redis.Redis, older_than_s: float) -> list[Share]:
    """Shares no worker has claimed for a while: the message was lost (e.g. the api died
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
        share_of(attempt, alloc)
        for attempt, alloc in rows
        if not client.exists(streams.attempt_claim_key(attempt.run_id, attempt.number, alloc.node_rank))
    ]


def share_of(attempt: Attempt, alloc: Allocation) -> Share:
    first = next(a for a in attempt.allocations if a.node_rank == 0)
    return Share(
        attempt.run_id, attempt.number, alloc.node_id, attempt.run.spec,
        alloc.node_rank, len(attempt.allocations), first.node.host, tuple(alloc.gpus),
    )  # fmt: skip


@lru_cache
def _celery(broker_url: str) -> Celery:
    """A sending-only Celery app: the api dispatches by task name and never imports the worker."""
    return make_celery(broker_url)


def dispatch(client: redis.Redis, shares: list[Share], settings: Settings | None = None) -> None:
    settings = settings or get_settings()
    for p in shares:
        attempts.open_run_streams(client, p.run_id)
        args: list[object] = [p.run_id, p.attempt, p.spec]
        workload = RunSpec.model_validate(p.spec).workload
        if isinstance(workload, ScriptConfig):  # the worker fetches the code with this, no token needed
            args.append(bundles.capability(settings, workload.bundle))
        gang = {
            "node_rank": p.node_rank,
            "nnodes": p.nnodes,
            "rdzv_host": p.rdzv_host,
            "cancel_token": attempts.cancel_token(settings, p.run_id),
            "gpus": list(p.gpus),
        }
        _celery(settings.redis_url).send_task(RUN_ATTEMPT_TASK, args=args, kwargs=gang, queue=node_queue(p.node_id))
        log.info("dispatched run %s attempt %s (node rank %s) to %s", p.run_id, p.attempt, p.node_rank, p.node_id)


RANK_USERS_EVERY_S = 10.0
_rank_users_checked = 0.0


def retire_rank_users(client: redis.Redis) -> int:
    """Deletes the Redis users of attempts that have ended (or that the database does not know):
    a worker deletes its share's user itself, but not if it died first. Returns how many went."""
    names: Any = client.execute_command("ACL", "USERS")
    owned = {}
    for raw in names:
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        parsed = streams.parse_rank_user(name)
        if parsed is not None:
            owned[name] = parsed
    if not owned:
        return 0
    with transaction() as session:
        live = set(
            session.execute(
                select(Attempt.run_id, Attempt.number).where(
                    Attempt.run_id.in_({run for run, _, _ in owned.values()}), Attempt.ended_at.is_(None)
                )
            ).tuples()
        )
    stale = [name for name, (run, number, _) in owned.items() if (run, number) not in live]
    if stale:
        client.execute_command("ACL", "DELUSER", *stale)
        with contextlib.suppress(redis.ResponseError):  # a Redis without an ACL file keeps none anyway
            client.execute_command("ACL", "SAVE")
        log.info("deleted %d Redis user(s) of ended attempts: %s", len(stale), ", ".join(stale))
    return len(stale)


def schedule_once(client: redis.Redis, settings: Settings) -> list[Share]:
    global _rank_users_checked
    if time.monotonic() - _rank_users_checked >= RANK_USERS_EVERY_S:
        _rank_users_checked = time.monotonic()
        try:
            retire_rank_users(client)
        except Exception:
            log.exception("could not retire the Redis users of ended attempts; trying again later")
    with transaction() as session:
        lost = nodes.sync_from_heartbeats(session, client)
        if lost:
            fail_runs_on_lost_nodes(session, lost, settings.node_timeout_s)
        watchdog.stop_stalled_and_overdue(session, settings)
        attempts.reconcile(session, client, settings)
        shares = place_queued_runs(session)
        lost_messages = unclaimed_shares(session, client, REDISPATCH_AFTER_S)
    for p in lost_messages:
        log.warning("run %s attempt %s was never claimed by %s: sending it again", p.run_id, p.attempt, p.node_id)
    dispatch(client, shares + lost_messages, settings)
    return shares


def serve(
    stop: threading.Event | None = None,
    one_pass: Callable[[redis.Redis, Settings], object] = schedule_once,
) -> None:
    """Runs passes until ``stop``; only the holder of the leader lock schedules. ``one_pass``: the
    built-in pool's alone by default; ``executors.serve`` passes every pool's."""
    settings = get_settings()
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=30)
    lifecycle.set_publisher(client)
    stop = stop or threading.Event()

    def wait(interval_s: float) -> None:
        try:  # sleep until the interval passes or a submit wakes us
            client.blpop([streams.SCHEDULER_WAKE], timeout=interval_s)
        except redis.ResponseError as exc:  # WRONGTYPE: not a list; it is only a wake-up call, so it goes
            log.warning("%s is not a list (%s): deleting it", streams.SCHEDULER_WAKE, exc)
            client.delete(streams.SCHEDULER_WAKE)
            client.hincrby(streams.REJECTED, "wake-not-a-list", 1)
            stop.wait(interval_s)
        except redis.RedisError:
            stop.wait(interval_s)

    leader.lead(
        client,
        streams.SCHEDULER_LOCK,
        settings.scheduler_interval_s,
        lambda: one_pass(client, settings),
        wait,
        stop,
        "scheduler",
    )
