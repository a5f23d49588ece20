"""Runs that hang or overstay: a running run with no step for ``training.stall_timeout_s`` (once
its attempt has made a first step) is diagnosed (its ranks' hang dumps, compared across ranks by
``backend/diagnosis.py``), then restarted from its last checkpoint (or failed once out of attempts)
with the diagnosis in its reason; one past ``training.max_duration_s`` is stopped. Checked on every
scheduler pass."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from backend import attempts, diagnoses, lifecycle
from backend.models import Run, utcnow


def stop_stalled_and_overdue(session: Session) -> None:
    now = utcnow()
    running = session.scalars(
        select(Run).where(Run.status == lifecycle.RUNNING).options(selectinload(Run.attempts))
    ).all()
    for run in running:
        training = run.run_spec.training
        stall_s, max_s = training.stall_timeout_s, training.max_duration_s
        attempt = run.attempts[-1] if run.attempts else None
        if attempt is None or attempt.ended_at is not None:
            continue
        if max_s and run.started_at and (now - run.started_at).total_seconds() > max_s:
            attempts.end_attempt(session, attempt, lifecycle.FAILED)
            lifecycle.transition(
                session, run, lifecycle.FAILED, f"stopped: running longer than training.max_duration_s ({max_s:g} s)"
            )
            continue
        # The clock starts at the attempt's first step: start-up (rendezvous, loading, calibration)
        # varies with the cluster and is bounded by torch's own timeouts.
        stepped = (
            run.last_step_at is not None and attempt.started_at is not None and run.last_step_at > attempt.started_at
        )
        if stall_s and stepped and (now - run.last_step_at).total_seconds() > stall_s:  # type: ignore[operator]
            # First the ranks say where they are stuck; the attempt ends once they did, or once
            # hangdump.STALL_WAIT_S has passed without them.
            asked = diagnoses.newest(session, run.id, "stall", attempt.number)
            if asked is None or asked.requested_at < run.last_step_at:  # type: ignore[operator]
                diagnoses.request(session, run, attempt, "stall")
                continue
            if diagnoses.status(asked, now) == diagnoses.PENDING:
                continue
            found = diagnoses.summary(asked)["headline"]
            attempts.end_attempt(session, attempt, lifecycle.FAILED)
            attempts.fail_or_restart(
                session,
                run,
                f"stalled: no step for {stall_s:g} s (training.stall_timeout_s; last step {run.last_step}); "
                f"diagnosis: {found}",
            )
