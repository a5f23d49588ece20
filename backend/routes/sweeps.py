"""/api/v1/sweeps: submit a hyperparameter sweep, list and read sweeps with their trials and their
parameters' importance, cancel one. The controller that runs them is ``backend/sweeper.py``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status

from backend import bundles, datasets, run_signals, runs, sweep_spec, sweep_study, sweeps
from backend.deps import DB_INT_MAX, Member, RedisDep, SessionDep, Viewer, check_owner
from backend.models import Sweep
from backend.schemas import SweepImportanceOut, SweepOut, SweepPage, TrialOut
from backend.sweep_spec import SweepSpec
from torchyard import streams
from torchyard.settings import get_settings
from torchyard.spec import ScriptConfig
from torchyard.states import TrialState

router = APIRouter(prefix="/api/v1/sweeps", tags=["sweeps"])
SweepId = Annotated[int, Path(ge=1, le=DB_INT_MAX, description="the sweep's id")]


def sweep_out(sweep: Sweep) -> SweepOut:
    spec = SweepSpec.model_validate(sweep.spec)
    best = sweeps.best_trial(sweep, spec.objective)
    trials = [
        TrialOut(
            number=t.number,
            run_id=t.run_id,
            params=t.params,
            state=t.state,
            value=t.value,
            pruned_at=t.pruned_at,
            reported_step=t.reported_step,
            reason=t.reason,
            run_status=t.run.status if t.run is not None else None,
            created_at=t.created_at,
            ended_at=t.ended_at,
        )
        for t in sweep.trials
    ]
    return SweepOut(
        id=sweep.id,
        name=sweep.name,
        status=sweep.status,
        status_reason=sweep.status_reason,
        spec=spec,
        created_at=sweep.created_at,
        ended_at=sweep.ended_at,
        best_trial=best.number if best else None,
        best_value=best.value if best else None,
        trials=trials,
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=SweepOut)
def create_sweep(spec: SweepSpec, session: SessionDep, redis: RedisDep, token: Member) -> SweepOut:
    """Checked whole before anything starts: the base spec as a run's would be (a 422 naming the
    field), and every parameter of the space against it (a path it lacks, an empty range, a type
    its field cannot take, a bound or choice that makes the spec invalid: a 422 naming it). Its
    trials start as the controller's next pass asks Optuna for them."""
    settings = get_settings()
    if isinstance(spec.base.workload, ScriptConfig):
        bundles.check_script_workload(settings, spec.base.workload)
    datasets.check_run_data(session, spec.base)
    runs.check_cluster_can_hold(session, spec.base.resources, settings.allow_waiting_for_nodes)
    sweep_spec.check_space(spec, token, settings.max_member_priority)
    sweep = sweeps.create_sweep(session, spec, token)
    session.commit()
    redis.rpush(streams.SWEEPER_WAKE, sweep.id)
    return sweep_out(sweep)


@router.get("", response_model=SweepPage)
def list_sweeps(
    session: SessionDep,
    _viewer: Viewer,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=DB_INT_MAX)] = 0,
) -> SweepPage:
    items, total = sweeps.list_sweeps(session, limit, offset)
    return SweepPage(items=[sweep_out(s) for s in items], total=total, limit=limit, offset=offset)


@router.get("/{sweep_id}", response_model=SweepOut)
def get_sweep(sweep_id: SweepId, session: SessionDep, _viewer: Viewer) -> SweepOut:
    return sweep_out(sweeps.get_sweep(session, sweep_id))


@router.get("/{sweep_id}/importance", response_model=SweepImportanceOut)
def get_importance(sweep_id: SweepId, session: SessionDep, _viewer: Viewer) -> SweepImportanceOut:
    """How much each parameter of the space mattered to the objective, over the complete trials so
    far (Optuna's PED-ANOVA: ``backend/sweep_study.py`` says why that evaluator)."""
    sweep = sweeps.get_sweep(session, sweep_id)
    spec = SweepSpec.model_validate(sweep.spec)
    done = [(t.params, t.value) for t in sweep.trials if t.state == TrialState.COMPLETE and t.value is not None]
    return SweepImportanceOut(
        evaluator=sweep_study.IMPORTANCE_EVALUATOR,
        trials=len(done),
        importance=sweep_study.importance(spec, ((p, v) for p, v in done if v is not None)),
    )


@router.post("/{sweep_id}/cancel", response_model=SweepOut, status_code=status.HTTP_202_ACCEPTED)
def cancel_sweep(sweep_id: SweepId, session: SessionDep, redis: RedisDep, token: Member) -> SweepOut:
    """No trial starts after this, and every unfinished run of the sweep is cancelled; 409 for a
    sweep that has ended."""
    sweep = sweeps.get_sweep(session, sweep_id)  # after the role check: a viewer learns nothing
    check_owner(sweep, token, "cancel")
    stopping = sweeps.cancel_sweep(session, sweep, f"sweep cancelled by {token.name}")
    session.commit()
    for run_id in stopping:
        run_signals.signal_cancel(redis, get_settings(), run_id)
    redis.rpush(streams.SWEEPER_WAKE, sweep.id)
    return sweep_out(sweep)
