"""/api/v1/runs/{id}/diagnose and /diagnosis: why a running run is stuck, asked of its ranks (their
Flight Recorders and Python stacks, ``torchyard/hangdump.py``) and compared across them
(``backend/diagnosis.py``). The watchdog asks too, before it ends a stalled attempt."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Response, status

from backend import diagnoses, lifecycle, runs
from backend.deps import Member, RunDep, RunId, SessionDep, check_owner
from backend.errors import Conflict, NotFound
from backend.models import Diagnosis, Run
from backend.schemas import DiagnosisOut

router = APIRouter(prefix="/api/v1/runs", tags=["diagnosis"])


@router.post("/{run_id}/diagnose", response_model=DiagnosisOut, status_code=status.HTTP_202_ACCEPTED)
def diagnose_run(run_id: RunId, session: SessionDep, token: Member) -> dict[str, Any]:
    """Asks every rank of the running attempt for its dump; ``202`` with the request ``pending``.
    Read the result at ``GET .../diagnosis`` (complete within seconds). Asking again while a request
    is pending answers that one. ``409`` unless the run is running."""
    run = runs.get_run(session, run_id)
    check_owner(run, token, "diagnose")
    attempt = run.attempts[-1] if run.attempts else None
    if run.status != lifecycle.RUNNING or attempt is None or attempt.ended_at is not None:
        raise Conflict(f"run {run_id} is {run.status}: only a running run can be diagnosed")
    asked = diagnoses.request(session, run, attempt, "user", token.name)
    session.commit()  # the workers hear of it once it is durable
    return diagnoses.summary(asked)


@router.get("/{run_id}/diagnosis", response_model=DiagnosisOut)
def get_diagnosis(run: RunDep, session: SessionDep) -> dict[str, Any]:
    """The run's latest diagnosis: per process group each rank's last collective, the ranks that
    never entered the one others wait in (or a mismatch), and the stuck ranks' innermost frames."""
    return diagnoses.summary(_latest(session, run))


@router.get("/{run_id}/diagnosis/dumps", response_class=Response)
def download_dumps(run: RunDep, session: SessionDep) -> Response:
    """The latest diagnosis's dumps as the ranks wrote them (torch's Flight Recorder JSON and every
    thread's stack), one JSON file."""
    asked = _latest(session, run)
    body = json.dumps(diagnoses.raw(asked), indent=1)
    name = f"run-{run.id}-attempt-{asked.attempt}-diagnosis-{asked.request[:8]}.json"
    return Response(
        body, media_type="application/json", headers={"Content-Disposition": f'attachment; filename="{name}"'}
    )


def _latest(session: SessionDep, run: Run) -> Diagnosis:
    asked = diagnoses.newest(session, run.id)
    if asked is None:
        raise NotFound(
            f"run {run.id} has no diagnosis: POST /api/v1/runs/{run.id}/diagnose while it runs "
            "(a stall with training.stall_timeout_s is diagnosed too)"
        )
    return asked
