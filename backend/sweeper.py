"""The sweep controller: one leader at a time (``backend/leader.py``, like the scheduler) drives
every running sweep. Each pass, per sweep, in one transaction:

- each unfinished trial's objective, as ingest has stored it, is reported to Optuna step by step
  and the pruner asked; a pruned trial's run is cancelled ("pruned at step N: ...");
- a trial whose run ended is told to Optuna: its value (complete), or its failure;
- while fewer than ``max_concurrent`` trials' runs are unfinished and fewer than ``n_trials`` were
  made, Optuna is asked for parameters (ask/tell) and the trial becomes an ordinary run, made as
  the runs route makes one (``runs.create_run``, under the owner's quota and bounds);
- once every trial has ended, the sweep ends with its best trial.

The study's journal rows commit with the trials and runs they describe (``backend/sweep_study.py``),
so a restart mid-sweep goes on from the database: no trial lost, no number given twice. A trial's
run that loses a node restarts as the same run: the trial follows it."""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import optuna
import redis
from optuna.trial import TrialState as OptunaState
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend import leader, lifecycle, run_signals, runs, sweep_spec, sweep_study, sweeps
from backend.db import transaction
from backend.errors import InvalidRequest
from backend.models import Sweep, SweepTrial, Token, utcnow
from backend.sweep_spec import AshaPruner, SweepSpec
from torchyard import streams
from torchyard.settings import Settings, get_settings
from torchyard.spec import RunSpec
from torchyard.states import TERMINAL, RunState, SweepState, TrialState

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What a pass over one sweep leaves Redis to be told once it has committed."""

    created: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)


class SweepController:
    """Holds each sweep's study between passes (its sampler's state with it); a pass that fails
    forgets the study, and the next replays it from the database."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client, self.settings = client, settings
        self.studies: dict[int, tuple[optuna.Study, sweep_study.DbJournal]] = {}

    def run_once(self) -> None:
        with transaction() as session:
            ids = list(
                session.scalars(
                    select(Sweep.id)
                    .where(Sweep.status == SweepState.RUNNING)
                    .union(
                        select(SweepTrial.sweep_id).where(SweepTrial.state == TrialState.RUNNING)
                    )  # a cancelled sweep's trials still end
                )
            )
        for sweep_id in sorted(ids):
            try:
                with transaction() as session:
                    outcome = self.advance(session, sweeps.get_sweep(session, sweep_id))
                    run_signals.clear_streams(self.client, outcome.created)
            except Exception:
                self.studies.pop(sweep_id, None)  # it may hold journal entries that never committed
                log.exception("sweep %s: pass failed; retrying", sweep_id)
                continue
            for run_id in outcome.cancelled:
                run_signals.signal_cancel(self.client, self.settings, run_id)
            run_signals.wake_scheduler(self.client, outcome.created)

    def study(self, sweep: Sweep, spec: SweepSpec, session: Session) -> optuna.Study:
        if sweep.id not in self.studies:
            self.studies[sweep.id] = sweep_study.open_study(sweep.id, spec, session)
        study, journal = self.studies[sweep.id]
        journal.session = session  # this pass's transaction reads and writes the journal
        return study

    def advance(self, session: Session, sweep: Sweep) -> Outcome:
        spec = SweepSpec.model_validate(sweep.spec)
        study = self.study(sweep, spec, session)
        outcome = Outcome()
        for trial in sweep.trials:
            if trial.state == TrialState.RUNNING:
                self._follow(session, study, spec, trial, outcome)
        if sweep.status == SweepState.RUNNING:
            self._launch(session, study, spec, sweep, outcome)
            self._finish_if_done(sweep, spec)
        return outcome

    def _follow(self, session: Session, study: optuna.Study, spec: SweepSpec, trial: SweepTrial, out: Outcome) -> None:
        run = trial.run
        if run is None:  # its run was deleted
            _end(study, trial, TrialState.FAILED, "its run is gone")
            return
        ended = run.status in TERMINAL
        objective = spec.objective
        points = sweeps.step_values(session, run, objective.metric, trial.reported_step, complete_only=not ended)
        handle = optuna.trial.Trial(study, _trial_id(study, trial.number))
        worst = math.inf if objective.direction == "minimize" else -math.inf
        for step, value in points:
            handle.report(worst if value is None or not math.isfinite(value) else value, step)
            trial.reported_step = step
        if ended:
            self._conclude(session, study, spec, trial, run.status, run.status_reason)
            return
        if points and run.status != RunState.CANCELLING and handle.should_prune():
            step, value = points[-1]
            reason = f"pruned at step {step}: {objective.metric} {_fmt(value)} {_why_pruned(spec)}"
            runs.request_cancel(session, run, reason)
            out.cancelled.append(run.id)
            trial.pruned_at = step
            _end(study, trial, TrialState.PRUNED, reason)

    def _conclude(
        self, session: Session, study: optuna.Study, spec: SweepSpec, trial: SweepTrial, status: str, why: str
    ) -> None:
        if status == RunState.SUCCEEDED:
            run = trial.run
            assert run is not None
            points = sweeps.step_values(session, run, spec.objective.metric, 0, complete_only=False)
            value = sweeps.objective_value(points, spec.objective)
            if value is None:
                detail = "logged no" if not points else "ended with a non-finite"
                _end(study, trial, TrialState.FAILED, f"run succeeded but {detail} {spec.objective.metric!r}")
            else:
                _end(study, trial, TrialState.COMPLETE, "", value)
        elif status == RunState.CANCELLED:
            _end(study, trial, TrialState.CANCELLED, why)
        else:
            _end(study, trial, TrialState.FAILED, why)

    def _launch(self, session: Session, study: optuna.Study, spec: SweepSpec, sweep: Sweep, out: Outcome) -> None:
        owner = session.get(Token, sweep.owner_id) if sweep.owner_id is not None else None
        if owner is None or owner.revoked_at is not None:
            sweep.status_reason = "waiting: its owner's token is revoked; no trial starts"
            return
        base = spec.base.model_dump(mode="json")
        made, busy = len(sweep.trials), sweeps.in_flight(sweep)
        while made < spec.n_trials and busy < spec.max_concurrent:
            # Asked only when its run can be made: the ask and the run commit together.
            unfinished = runs.unfinished_count(session, owner)
            if unfinished >= self.settings.max_runs_in_flight:
                sweep.status_reason = (
                    f"waiting: token {owner.name!r} has {unfinished} unfinished runs, the most allowed "
                    f"(TORCHYARD_MAX_RUNS_IN_FLIGHT={self.settings.max_runs_in_flight})"
                )
                return
            trial = self._start_trial(session, study, spec, sweep, base, owner)
            made += 1
            if trial.run_id is not None:
                busy += 1
                out.created.append(trial.run_id)
        if busy or made < spec.n_trials:
            sweep.status_reason = f"{made} of {spec.n_trials} trials started; {busy} running"

    def _start_trial(
        self,
        session: Session,
        study: optuna.Study,
        spec: SweepSpec,
        sweep: Sweep,
        base: dict[str, Any],
        owner: Token,
    ) -> SweepTrial:
        number, params = sweep_study.ask(study, spec)
        trial = SweepTrial(sweep_id=sweep.id, number=number, params=params, state=TrialState.RUNNING, reported_step=0)
        sweep.trials.append(trial)
        run_json = sweep_spec.spec_with(base, params)
        run_json["name"] = f"{sweep.name} · trial {number}"[:200]
        try:
            run_spec = RunSpec.model_validate(run_json)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            _end(study, trial, TrialState.FAILED, f"its parameters make an invalid spec: {where}: {first['msg']}")
            session.flush()
            return trial
        settings = self.settings
        try:
            run = runs.create_run(
                session,
                run_spec,
                owner,
                settings.max_runs_in_flight,
                settings.max_member_priority,
                settings.allow_waiting_for_nodes,
            )
        except InvalidRequest as exc:  # a rule of the owner's (priority): this trial fails, the sweep goes on
            _end(study, trial, TrialState.FAILED, f"its parameters make a run its owner cannot submit: {exc.msg}")
            session.flush()
            return trial
        trial.run = run
        session.flush()
        return trial

    def _finish_if_done(self, sweep: Sweep, spec: SweepSpec) -> None:
        if len(sweep.trials) < spec.n_trials or any(t.state == TrialState.RUNNING for t in sweep.trials):
            return
        best = sweeps.best_trial(sweep, spec.objective)
        sweep.ended_at = utcnow()
        if best is None:
            sweep.status, sweep.status_reason = SweepState.FAILED, "no trial gave a value"
        else:
            sweep.status = SweepState.SUCCEEDED
            sweep.status_reason = f"best: trial {best.number}, {spec.objective.metric} {_fmt(best.value)}"


def _trial_id(study: optuna.Study, number: int) -> int:
    return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)


def _end(study: optuna.Study, trial: SweepTrial, state: TrialState, reason: str, value: float | None = None) -> None:
    """Tells Optuna how the trial ended and records it (a pruned trial: its last reported value)."""
    if state == TrialState.COMPLETE:
        study.tell(trial.number, value)
    elif state == TrialState.PRUNED:
        study.tell(trial.number, state=OptunaState.PRUNED)
    else:
        study.tell(trial.number, state=OptunaState.FAIL)
    trial.state, trial.reason, trial.value, trial.ended_at = state, reason, value, utcnow()


def _why_pruned(spec: SweepSpec) -> str:
    p = spec.pruner
    if isinstance(p, AshaPruner):
        return (
            f"is not in the best 1/{p.reduction_factor} of the trials at this rung "
            f"(asha: min_steps {p.min_steps}, reduction_factor {p.reduction_factor})"
        )
    return "is worse than the median of earlier trials at this step (median pruner)"


def _fmt(value: float | None) -> str:
    return "NaN" if value is None else f"{value:.4g}"


def serve(stop: threading.Event | None = None) -> None:
    """Runs passes until ``stop``; only the holder of the leader lock drives sweeps."""
    settings = get_settings()
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=30)
    lifecycle.set_publisher(client)
    stop = stop or threading.Event()
    controller = SweepController(client, settings)
    interval = max(settings.scheduler_interval_s, 0.5)

    def wait(interval_s: float) -> None:
        try:
            client.blpop([streams.SWEEPER_WAKE], timeout=interval_s)
        except redis.RedisError:
            stop.wait(interval_s)

    leader.lead(client, streams.SWEEPER_LOCK, interval, controller.run_once, wait, stop, "sweep controller")
