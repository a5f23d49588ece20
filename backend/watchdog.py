"""Runs that hang or overstay: a running run with no step for ``training.stall_timeout_s`` (once
its attempt has made a first step) is diagnosed (its ranks' hang dumps, compared across ranks by
``backend/diagnosis.py``), then restarted from its last checkpoint (or failed once out of attempts)
with the diagnosis in its reason; one past ``training.max_duration_s`` is stopped. Checked on every
scheduler pass.

A run that set no ``stall_timeout_s`` is still watched: with no step for ``stall_alert_factor`` ×
its mean step time (since its attempt began: start-up counted, which errs long), and never sooner
than ``stall_alert_floor_s``, its ranks are diagnosed and a ``stall`` alert raised with the
diagnosis in its text (an event, the run page, ``/metrics``). It is flagged, not stopped: a long
evaluation or checkpoint between steps looks the same from here, and only its user can say how
long is too long (``stall_timeout_s``). The alert ends when a step comes again."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from backend import alerts, attempts, diagnoses, lifecycle
from backend.models import Attempt, Run, utcnow
from torchyard.settings import Settings


def stop_stalled_and_overdue(session: Session, settings: Settings) -> None:
    now = utcnow()
    running = session.scalars(
        select(Run).where(Run.status == lifecycle.RUNNING).options(selectinload(Run.attempts))
    ).all()
    flagged = alerts.holding(session, alerts.AlertKind.STALL)
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
        if not stall_s:
            flag_stalled(session, run, attempt, settings, now, stepped, run.id in flagged)
        elif stepped and (now - run.last_step_at).total_seconds() > stall_s:  # type: ignore[operator]
            found = stall_diagnosis(session, run, attempt, now)
            if found is None:
                continue
            attempts.end_attempt(session, attempt, lifecycle.FAILED)
            attempts.fail_or_restart(
                session,
                run,
                f"stalled: no step for {stall_s:g} s (training.stall_timeout_s; last step {run.last_step}); "
                f"diagnosis: {found}",
            )


def stall_diagnosis(session: Session, run: Run, attempt: Attempt, now: datetime) -> str | None:
    """What the ranks of a stalled attempt say, once they said it or hangdump.STALL_WAIT_S passed
    without them (its headline); None while asked (the first call asks: a stall is acted on only
    after the ranks were asked where they are stuck)."""
    asked = diagnoses.newest(session, run.id, "stall", attempt.number)
    if asked is None or asked.requested_at < run.last_step_at:  # type: ignore[operator]
        diagnoses.request(session, run, attempt, "stall")
        return None
    if diagnoses.status(asked, now) == diagnoses.PENDING:
        return None
    return str(diagnoses.summary(asked)["headline"])


def default_stall_s(run: Run, attempt: Attempt, settings: Settings) -> float:
    """How long without a step flags ``run``: ``stall_alert_factor`` × its mean step time so far in
    this attempt, at least ``stall_alert_floor_s``."""
    steps = run.last_step - (attempt.first_step or 1) + 1
    elapsed = (run.last_step_at - attempt.started_at).total_seconds() if run.last_step_at and attempt.started_at else 0
    return max(settings.stall_alert_floor_s, settings.stall_alert_factor * elapsed / max(steps, 1))


def flag_stalled(
    session: Session, run: Run, attempt: Attempt, settings: Settings, now: datetime, stepped: bool, holding: bool
) -> None:
    """The default stall detection (the module's docstring): diagnose, then raise the alert with
    what the ranks said; end it once a step came again. ``holding``: the run's stall alert holds."""
    quiet_s = (now - run.last_step_at).total_seconds() if stepped and run.last_step_at else 0.0
    bound = default_stall_s(run, attempt, settings)
    if not stepped or not settings.stall_alert_floor_s or quiet_s <= bound:
        if holding:
            alerts.end_alert(session, run.id, alerts.AlertKind.STALL)
        return
    found = None if holding else stall_diagnosis(session, run, attempt, now)
    if found is None:
        return
    alerts.raise_alert(
        session,
        run.id,
        alerts.AlertKind.STALL,
        run.last_step,
        f"stalled: no step for {quiet_s:.0f} s after step {run.last_step} (default detection: {bound:.0f} s, "
        f"{settings.stall_alert_factor:g}x its mean step time, at least {settings.stall_alert_floor_s:g} s; still "
        f"running: set training.stall_timeout_s to restart or fail it); diagnosis: {found}",
    )
