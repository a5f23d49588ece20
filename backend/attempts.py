"""Attempt outcomes: what a worker's report means for its attempt and run, ending an attempt and
the node shares (allocations) that hold its slots, and the periodic reconciliation that ends what
no report will ever end. Ingest only writes data and hands reports here; the watchdog and the
scheduler end attempts through here too.

Slots: a share holds its node's slots from placement until its worker reports the share's exit
(so a new run never lands on ranks still winding down), until its node is lost, or, when
neither comes, until ``reconcile`` gives up waiting (``WIND_DOWN_SLACK_S`` past the grace the
worker had to end it). A share that never started holds nothing once its attempt has ended."""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any

import redis
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from backend import lifecycle
from backend.models import Allocation, Attempt, Run, utcnow
from torchyard import streams
from torchyard.settings import Settings, secret_key
from torchyard.spec import RunSpec
from torchyard.states import RunState

log = logging.getLogger(__name__)

# After the worker's SIGTERM → SIGKILL grace, how long the server still waits for the exit report
# of a share of an ended attempt before freeing its slots anyway (the report was lost).
WIND_DOWN_SLACK_S = 10.0
# A cancelled run's attempt that no worker has claimed this long never will be (the message was
# lost): there is nothing to stop, so the cancel completes without it.
CLAIM_GRACE_S = 10.0


def cancel_token(settings: Settings, run_id: int) -> str:
    """The value of a run's cancel key when the api set it. The scheduler sends it to the run's
    workers with each attempt; a worker obeys a cancel key only with this value, so a key that
    someone else set (anyone who can write to Redis) cannot end another user's run."""
    return hmac.new(secret_key(settings), f"cancel:{run_id}".encode(), hashlib.sha256).hexdigest()


def end_attempt(session: Session, attempt: Attempt, status: str, returncode: int | None = None) -> None:
    """Ends an attempt on the server's side. Once this commits, every node still running a share
    of it is told to stop (the end key): the first node of a gang to fail ends the gang. A share
    that never started holds no processes, so its slots are free at once; a started one keeps
    them until its worker reports the exit (or ``reconcile`` stops waiting)."""
    now = utcnow()
    attempt.status, attempt.ended_at, attempt.returncode = status, now, returncode
    for share in attempt.allocations:
        if share.ended_at is None and share.started_at is None:
            share.ended_at = now  # exit_status stays NULL: a late report of its worker fills it in
    session.info.setdefault("ended_attempts", []).append((attempt.run_id, attempt.number))


def apply_report(session: Session, run_id: int, data: dict[str, Any]) -> None:
    """A worker's word on its node's share of an attempt: it started, or it exited and how. An
    attempt succeeds when every node of its gang succeeded; the first share to end otherwise
    ends the attempt (and, once committed, the rest of the gang). Reports may come in any order
    and late: a share's exit is recorded even when its attempt or run ended long before."""
    run = session.get(Run, run_id)
    attempt = session.scalar(select(Attempt).where(Attempt.run_id == run_id, Attempt.number == data["attempt"]))
    if run is None or attempt is None:
        return
    share = next((a for a in attempt.allocations if a.node_id == data["node"]), None)
    if data["event"] == "started":
        if share is not None and share.started_at is None:
            share.started_at = utcnow()
        if attempt.ended_at is not None:
            return  # a late node of a gang that already ended: the end key stops it
        if attempt.started_at is None:
            attempt.status, attempt.started_at = lifecycle.RUNNING, utcnow()
        if run.status == lifecycle.SCHEDULED:
            lifecycle.transition(session, run, lifecycle.RUNNING, f"started on {data['node']}")
        return
    if share is not None and share.exit_status is None:
        share.exit_status = data["status"]
        share.ended_at = share.ended_at or utcnow()  # its node's slots are free again
    if attempt.ended_at is not None:
        return  # already settled (a redelivered report, or a gang member ending after the first)
    to = data["status"]
    if to == lifecycle.SUCCEEDED and any(a.ended_at is None for a in attempt.allocations):
        return  # the rest of the gang is still finishing
    if to == lifecycle.SUCCEEDED and attempt.slurm_job_id is not None:
        return  # one node of a Slurm job: the job's COMPLETED (every node's step exited 0) ends it (backend/slurm.py)
    end_attempt(session, attempt, to, data.get("returncode"))
    reason = data.get("reason") or f"attempt {data['attempt']} {to}"
    if to == lifecycle.CANCELLED and run.status != lifecycle.CANCELLING:
        # The node obeyed a cancel the api never issued (a key set by someone else): not the run's
        # own failure, and not the owner's cancel either. It goes on from its checkpoint.
        fail_or_restart(session, run, f"attempt {data['attempt']} was stopped by a cancel nobody asked the api for")
        return
    if data.get("retryable") and to == lifecycle.FAILED:
        fail_or_restart(session, run, data.get("reason") or f"attempt {data['attempt']} lost its node")
        return
    if run.status == lifecycle.CANCELLING and to == lifecycle.FAILED:
        to = lifecycle.CANCELLED  # a rank killed by our own SIGTERM is a cancel, not a failure
    if lifecycle.can_transition(run, to):
        lifecycle.transition(session, run, to, reason)
    else:
        log.warning("run %s is %s; ignoring its attempt's exit as %s", run_id, run.status, to)


def open_run_streams(client: redis.Redis, run_id: int) -> None:
    """Both of the run's streams (submit left them empty), each with ingest's consumer group: what
    the platform writes and what its ranks write (torchyard/streams.py), read with their own rules."""
    for stream in (streams.run_stream(run_id), streams.rank_stream(run_id)):
        try:
            client.xgroup_create(stream, streams.INGEST_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        client.sadd(streams.ACTIVE_STREAMS, stream)


def record_facts(session: Session, run_id: int, number: int, facts: dict[str, Any]) -> None:
    """Rank 0's facts of an attempt (screened: ``backend/screening.py``); a repeat replaces them."""
    session.execute(update(Attempt).where(Attempt.run_id == run_id, Attempt.number == number).values(facts=facts))


def fail_or_restart(session: Session, run: Run, reason: str) -> None:
    """The run's node failed it (lost, or its worker restarted), not its own code: a new attempt
    resumes from the last checkpoint while the run has attempts left."""
    if run.status == lifecycle.CANCELLING:
        lifecycle.transition(session, run, lifecycle.CANCELLED, reason)
        return
    allowed = run.run_spec.training.max_attempts
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


def wind_down_s(settings: Settings, spec: RunSpec) -> float:
    """The longest a worker takes to end a share after its attempt ended (its SIGTERM → SIGKILL
    grace, ``TrainingConfig.cancel_grace``), plus the slack for its report to arrive."""
    # a share ended because its attempt ended elsewhere gets the worker's default grace
    grace = max(settings.cancel_grace_s, spec.training.cancel_grace(settings.cancel_grace_s))
    return grace + WIND_DOWN_SLACK_S


def reconcile(session: Session, client: redis.Redis, settings: Settings) -> None:
    """What no report will end, ended by the scheduler's leader on every pass:
    - a started share of an ended attempt whose exit report never came (lost with a Redis that
      restarted, or a worker that died and came back without its records): its slots are freed
      once its worker has surely ended it;
    - a run in ``cancelling`` whose processes are gone: its attempt ended already (e.g. its
      exit came while it was not yet cancelling), or no live worker holds any share of it (never
      claimed, or claimed by a node that is no longer heartbeating)."""
    now = utcnow()
    open_shares = session.execute(
        select(Allocation, Attempt, Run)
        .join(Attempt, Allocation.attempt_id == Attempt.id)
        .join(Run, Attempt.run_id == Run.id)
        .where(Allocation.ended_at.is_(None), Attempt.ended_at.is_not(None))
    ).all()
    for share, attempt, run in open_shares:
        waited = (now - (attempt.ended_at or now)).total_seconds()
        if waited > wind_down_s(settings, run.run_spec):
            log.warning(
                "run %s attempt %s: no exit report from %s %.0f s after the attempt ended; freeing its slots",
                run.id, attempt.number, share.node_id, waited,
            )  # fmt: skip
            share.ended_at = now
    for run in session.scalars(select(Run).where(Run.status == RunState.CANCELLING)).all():
        latest = run.attempts[-1] if run.attempts else None
        if latest is None or latest.ended_at is not None:
            lifecycle.transition(session, run, lifecycle.CANCELLED, "cancelled: no process of the run is left")
        elif latest.slurm_job_id is not None:
            continue  # Slurm's job says when its processes are gone (backend/slurm.py)
        elif (now - latest.created_at).total_seconds() > CLAIM_GRACE_S and not _held_by_a_live_worker(client, latest):
            end_attempt(session, latest, lifecycle.CANCELLED)
            lifecycle.transition(session, run, lifecycle.CANCELLED, "cancelled: no live worker held the run")


def _held_by_a_live_worker(client: redis.Redis, attempt: Attempt) -> bool:
    """Some share of the attempt is claimed by a node that still heartbeats."""
    if not attempt.allocations:
        return False
    claims: Any = client.mget(
        [streams.attempt_claim_key(attempt.run_id, attempt.number, s.node_rank) for s in attempt.allocations]
    )
    nodes = [c.decode() for c in claims if c]
    return bool(nodes) and any(client.mget([streams.node_key(n) for n in nodes]))
