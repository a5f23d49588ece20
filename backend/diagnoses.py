"""The diagnoses data layer: asking a running attempt why it is stuck, recording each node's answer
(ingest), and reading a diagnosis back with what its dumps mean (``backend/diagnosis.py``).
Flushes, never commits. The request reaches the workers once the transaction commits
(``backend/lifecycle.py`` publishes the attempt's diagnose key)."""

from __future__ import annotations

import json
import logging
import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend import diagnosis
from backend.models import Attempt, Diagnosis, DiagnosisAnswer, Run, utcnow
from torchyard import hangdump

log = logging.getLogger(__name__)

KEEP_PER_RUN = 10  # the newest diagnoses of a run are kept; older ones go with their dumps
PENDING, COMPLETE, PARTIAL = "pending", "complete", "partial"


def request(session: Session, run: Run, attempt: Attempt, trigger: str, by: str = "") -> Diagnosis:
    """A new request to the attempt's ranks, or the one of the same trigger still waiting for its
    answers (asking again meanwhile costs nothing)."""
    latest = newest(session, run.id, trigger, attempt.number)
    if latest is not None and status(latest) == PENDING:
        return latest
    spec = run.run_spec
    asked = Diagnosis(
        run_id=run.id,
        attempt=attempt.number,
        request=secrets.token_hex(16),
        trigger=trigger,
        requested_by=by,
        requested_at=utcnow(),
        nodes=max(1, len(attempt.allocations)),
        world=spec.resources.nodes * spec.resources.procs_per_node,
    )
    session.add(asked)
    session.flush()
    old = session.scalars(
        select(Diagnosis.id).where(Diagnosis.run_id == run.id).order_by(Diagnosis.id.desc()).offset(KEEP_PER_RUN)
    ).all()
    if old:
        session.execute(delete(DiagnosisAnswer).where(DiagnosisAnswer.diagnosis_id.in_(old)))
        session.execute(delete(Diagnosis).where(Diagnosis.id.in_(old)))
    session.info.setdefault("diagnose_requests", []).append((run.id, attempt.number, asked.request))
    return asked


def record_answer(session: Session, run_id: int, data: dict[str, Any]) -> None:
    """A node's answer from the platform stream. One per node and request (a redelivered entry
    changes nothing); an answer to a request the run never made is dropped."""
    asked = session.scalar(
        select(Diagnosis).where(Diagnosis.run_id == run_id, Diagnosis.request == str(data.get("request")))
    )
    if asked is None:
        log.warning("run %s: dropping a diagnosis answer to an unknown request", run_id)
        return
    dumps = data.get("dumps")
    missing = data.get("missing")
    answer = DiagnosisAnswer(
        diagnosis_id=asked.id,
        node_id=str(data.get("node"))[:200],
        received_at=utcnow(),
        dumps=json.dumps([d for d in dumps if isinstance(d, dict)] if isinstance(dumps, list) else []),
        missing=json.dumps({str(k): str(v)[:300] for k, v in missing.items()} if isinstance(missing, dict) else {}),
    )
    try:
        with session.begin_nested():
            session.add(answer)
    except IntegrityError:
        pass  # this node answered already


def newest(session: Session, run_id: int, trigger: str | None = None, attempt: int | None = None) -> Diagnosis | None:
    query = select(Diagnosis).where(Diagnosis.run_id == run_id)
    if trigger is not None:
        query = query.where(Diagnosis.trigger == trigger)
    if attempt is not None:
        query = query.where(Diagnosis.attempt == attempt)
    return session.scalar(query.order_by(Diagnosis.id.desc()).limit(1))


def status(asked: Diagnosis, now: datetime | None = None) -> str:
    """``complete``: every node answered; ``partial``: the wait for them is over; else ``pending``."""
    if len(asked.answers) >= asked.nodes:
        return COMPLETE
    waited = ((now or utcnow()) - asked.requested_at).total_seconds()
    return PARTIAL if waited > hangdump.STALL_WAIT_S else PENDING


def dumps(asked: Diagnosis) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every rank's dump that came, and why the others did not (by ``node/local rank``)."""
    out: list[dict[str, Any]] = []
    missing: dict[str, str] = {}
    for answer in asked.answers:
        out += json.loads(answer.dumps)
        missing.update({f"{answer.node_id}/{k}": v for k, v in json.loads(answer.missing).items()})
    return out, missing


def summary(asked: Diagnosis) -> dict[str, Any]:
    """The diagnosis as the api shows it: the request, its status and what the dumps mean."""
    state = status(asked)
    head = {
        "request": asked.request,
        "attempt": asked.attempt,
        "trigger": asked.trigger,
        "requested_by": asked.requested_by,
        "requested_at": asked.requested_at,
        "status": state,
        "nodes": asked.nodes,
        "nodes_answered": len(asked.answers),
        "answered_at": max((a.received_at for a in asked.answers), default=None),
    }
    if state == PENDING:
        return {**head, "headline": "asking the ranks…", "findings": [], "ranks": [], "groups": [],
                "answered": 0, "world": asked.world}  # fmt: skip
    found, missing = dumps(asked)
    return {**head, **diagnosis.analyze(found, asked.world, missing)}


def raw(asked: Diagnosis) -> dict[str, Any]:
    """The dumps as the ranks wrote them, for download."""
    return {
        "run_id": asked.run_id,
        "attempt": asked.attempt,
        "request": asked.request,
        "requested_at": asked.requested_at.isoformat(),
        "nodes": [
            {"node": a.node_id, "dumps": json.loads(a.dumps), "missing": json.loads(a.missing)} for a in asked.answers
        ],
    }
