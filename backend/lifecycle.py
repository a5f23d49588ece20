"""Run states and the one table of legal transitions. Every change goes through
``transition``, which records an event and, once the transaction commits, tells live readers."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from backend.errors import Conflict
from backend.models import Run, RunEvent, utcnow
from torchyard import streams
from torchyard.states import TERMINAL, RunState

# Short names for the table below and for the modules that walk runs through it.
QUEUED, SCHEDULED, RUNNING = RunState.QUEUED, RunState.SCHEDULED, RunState.RUNNING
SUCCEEDED, FAILED, CANCELLED = RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED
CANCELLING, RESTARTING = RunState.CANCELLING, RunState.RESTARTING

TRANSITIONS: dict[RunState, frozenset[RunState]] = {
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


class IllegalTransition(Conflict):
    def __init__(self, run: Run, to: str) -> None:
        super().__init__(f"run {run.id} is {run.status}; it cannot become {to}")
        self.run_id, self.from_status, self.to_status = run.id, run.status, to


def can_transition(run: Run, to: str) -> bool:
    return to in TRANSITIONS[RunState(run.status)]


def transition(session: Session, run: Run, to: str, reason: str = "") -> RunEvent:
    if not can_transition(run, to):
        raise IllegalTransition(run, to)
    if run.status == CANCELLING and to == CANCELLED and run.status_reason and reason != run.status_reason:
        # Why it was cancelled (its owner, its sweep's pruner: "pruned at step N: ...") stays the
        # run's reason; how its processes ended (the worker's report, the reconciler) follows it.
        reason = f"{run.status_reason}; {reason}" if reason else run.status_reason
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


def record_alert(session: Session, run: Run, alert: str, reason: str) -> RunEvent:
    """An alert on a run (``backend/alerts.py``): an event in its history beside its transitions, its
    state unchanged, published to live readers as they are (a page re-reads the history)."""
    now = utcnow()
    ev = RunEvent(run_id=run.id, at=now, from_status=run.status, to_status=run.status, reason=reason, alert=alert)
    session.add(ev)
    session.info.setdefault("state_changes", []).append(
        (run.id, {"status": run.status, "from": run.status, "reason": reason, "at": now.isoformat(), "alert": alert})
    )
    return ev


# Live readers learn of a change only after it is durable: published on commit, never before.
_publisher: Any = None  # a redis.Redis, set by the process that owns one (api, scheduler, ingest)


def set_publisher(client: Any) -> None:
    global _publisher
    _publisher = client


@event.listens_for(Session, "after_commit")
def _publish_state_changes(session: Session) -> None:
    changes = session.info.pop("state_changes", [])
    ended = session.info.pop("ended_attempts", [])
    asked = session.info.pop("diagnose_requests", [])  # backend/diagnoses.py: the workers answer once committed
    if _publisher is None or not (changes or ended or asked):
        return
    pipe = _publisher.pipeline(transaction=False)
    for run_id, data in changes:
        pipe.xadd(streams.run_stream(run_id), streams.encode(streams.STATE, data))
    for run_id, number in ended:
        pipe.set(streams.attempt_end_key(run_id, number), "1", ex=7 * 86400)
    for run_id, number, request in asked:
        pipe.set(streams.diagnose_key(run_id, number), request, ex=3600)
    try:
        pipe.execute()
    except Exception:  # the database holds the change; a live view re-reads it on reconnect
        import logging

        logging.getLogger(__name__).warning("could not publish state changes to Redis", exc_info=True)


@event.listens_for(Session, "after_rollback")
def _forget_state_changes(session: Session) -> None:
    session.info.pop("state_changes", None)
    session.info.pop("ended_attempts", None)
    session.info.pop("diagnose_requests", None)
