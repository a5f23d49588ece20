"""Run states and the one table of legal transitions. Every change goes through
``transition``, which records an event and, once the transaction commits, tells live readers."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from backend.models import Attempt, Run, RunEvent, utcnow
from torchyard import streams

QUEUED, SCHEDULED, RUNNING, SUCCEEDED, FAILED = "queued", "scheduled", "running", "succeeded", "failed"
CANCELLING, CANCELLED, RESTARTING = "cancelling", "cancelled", "restarting"

TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
ACTIVE = frozenset({SCHEDULED, RUNNING, CANCELLING})  # an attempt holds slots on a node

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({SCHEDULED, CANCELLED, FAILED}),
    SCHEDULED: frozenset({RUNNING, CANCELLING, FAILED, RESTARTING, SUCCEEDED}),
    RUNNING: frozenset({SUCCEEDED, FAILED, CANCELLING, RESTARTING}),
    # A run may finish on its own before the cancel reaches it: say what really happened.
    CANCELLING: frozenset({CANCELLED, SUCCEEDED, FAILED}),
    RESTARTING: frozenset({SCHEDULED, CANCELLED, FAILED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


class IllegalTransition(Exception):
    def __init__(self, run: Run, to: str) -> None:
        super().__init__(f"run {run.id} is {run.status}; it cannot become {to}")
        self.run_id, self.from_status, self.to_status = run.id, run.status, to


def can_transition(run: Run, to: str) -> bool:
    return to in TRANSITIONS[run.status]


def transition(session: Session, run: Run, to: str, reason: str = "") -> RunEvent:
    if not can_transition(run, to):
        raise IllegalTransition(run, to)
    now = utcnow()
    ev = RunEvent(run_id=run.id, at=now, from_status=run.status, to_status=to, reason=reason)
    run.status, run.status_reason = to, reason
    if to == RUNNING and run.started_at is None:
        run.started_at = now
    if to in TERMINAL:
        run.ended_at = now
    session.add(ev)
    session.info.setdefault("state_changes", []).append(
        (run.id, {"status": to, "from": ev.from_status, "reason": reason, "at": now.isoformat()})
    )
    return ev


def end_attempt(session: Session, attempt: Attempt, status: str, returncode: int | None = None) -> None:
    """Ends an attempt on the server's side. Once this commits, every node still running a share
    of it is told to stop: the first node of a gang to fail ends the gang."""
    attempt.status, attempt.ended_at, attempt.returncode = status, utcnow(), returncode
    session.info.setdefault("ended_attempts", []).append((attempt.run_id, attempt.number))


# Live readers learn of a change only after it is durable: published on commit, never before.
_publisher: Any = None  # a redis.Redis, set by the process that owns one (api, scheduler, ingest)


def set_publisher(client: Any) -> None:
    global _publisher
    _publisher = client


@event.listens_for(Session, "after_commit")
def _publish_state_changes(session: Session) -> None:
    changes = session.info.pop("state_changes", [])
    ended = session.info.pop("ended_attempts", [])
    if _publisher is None or not (changes or ended):
        return
    pipe = _publisher.pipeline(transaction=False)
    for run_id, data in changes:
        pipe.xadd(streams.run_stream(run_id), streams.encode(streams.STATE, data))
    for run_id, number in ended:
        pipe.set(streams.attempt_end_key(run_id, number), "1", ex=7 * 86400)
    try:
        pipe.execute()
    except Exception:  # the database holds the change; a live view re-reads it on reconnect
        import logging

        logging.getLogger(__name__).warning("could not publish state changes to Redis", exc_info=True)


@event.listens_for(Session, "after_rollback")
def _forget_state_changes(session: Session) -> None:
    session.info.pop("state_changes", None)
    session.info.pop("ended_attempts", None)
