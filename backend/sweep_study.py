"""A sweep's Optuna study, kept in torchyard's own database as an Optuna *journal*: each storage
operation is one row of ``sweep_journal`` (sweep, seq, JSON), and the study is those rows replayed.

Why a journal and not Optuna's RDB storage: RDBStorage brings its own schema and its own alembic
history into the database, under the same ``alembic_version`` table torchyard's migrations use;
the journal is one table in our migrations. And its rows are written through the controller's own
session, so asking Optuna for a trial and creating that trial's run commit together or not at all:
a restart can neither lose a trial nor give its number twice (a second leader writing the same
``seq`` fails on the primary key and rolls back)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.importance import PedAnovaImportanceEvaluator
from optuna.pruners import BasePruner, MedianPruner, NopPruner, SuccessiveHalvingPruner
from optuna.samplers import BaseSampler, CmaEsSampler, GridSampler, RandomSampler, TPESampler
from optuna.storages import JournalStorage
from optuna.storages.journal import BaseJournalBackend
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend import sweep_spec
from backend.models import SweepJournalEntry
from backend.sweep_spec import AshaPruner, SweepSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)


class DbJournal(BaseJournalBackend):
    """One sweep's journal rows, read and written through ``session`` (set by the controller for
    each pass: the rows it appends commit with the pass's other changes)."""

    def __init__(self, sweep_id: int, session: Session) -> None:
        self.sweep_id, self.session = sweep_id, session

    def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
        rows = self.session.scalars(
            select(SweepJournalEntry.entry)
            .where(SweepJournalEntry.sweep_id == self.sweep_id, SweepJournalEntry.seq >= log_number_from)
            .order_by(SweepJournalEntry.seq)
        )
        return [json.loads(row) for row in rows]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        last = self.session.scalar(
            select(func.max(SweepJournalEntry.seq)).where(SweepJournalEntry.sweep_id == self.sweep_id)
        )
        start = -1 if last is None else last
        for i, log in enumerate(logs, start=start + 1):
            self.session.add(SweepJournalEntry(sweep_id=self.sweep_id, seq=i, entry=json.dumps(log)))
        self.session.flush()


class _Grid(GridSampler):
    """GridSampler whose last trial does not call ``study.stop()`` (which raises outside
    ``optimize``): a sweep's n_trials is at most the grid's points, so the sweep ends anyway."""

    def after_trial(self, study: optuna.Study, trial: Any, state: Any, values: Any) -> None:
        return None


def study_name(sweep_id: int) -> str:
    return f"sweep-{sweep_id}"


def sampler(spec: SweepSpec, made: int = 0) -> BaseSampler:
    """``made``: trials the study already has. A study replayed after a restart seeds its sampler
    with the seed plus that count: the same seed again would ask for the first trials' values again."""
    seed = None if spec.seed is None else (spec.seed + made) % 2**32
    if spec.sampler == "random":
        return RandomSampler(seed=seed)
    if spec.sampler == "grid":
        grid = {path: sweep_spec.grid_values(param) for path, param in spec.space.items()}
        return _Grid(grid, seed=seed)
    if spec.sampler == "cmaes":
        return CmaEsSampler(seed=seed)
    # A few random trials first (TPE models nothing from fewer), at most a third of the budget.
    return TPESampler(seed=seed, n_startup_trials=max(1, min(10, spec.n_trials // 3)))


def pruner(spec: SweepSpec) -> BasePruner:
    p = spec.pruner
    if isinstance(p, AshaPruner):
        return SuccessiveHalvingPruner(min_resource=p.min_steps, reduction_factor=p.reduction_factor)
    if p.kind == "median":
        return MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_steps)
    return NopPruner()


def open_study(sweep_id: int, spec: SweepSpec, session: Session) -> tuple[optuna.Study, DbJournal]:
    """The sweep's study, replayed from its journal (made on first use)."""
    journal = DbJournal(sweep_id, session)
    storage = JournalStorage(journal)
    direction = spec.objective.direction
    study = optuna.create_study(
        storage=storage,
        study_name=study_name(sweep_id),
        direction=direction,
        sampler=sampler(spec),
        pruner=pruner(spec),
        load_if_exists=True,
    )
    made = len(study.get_trials(deepcopy=False))
    if made:
        study.sampler = sampler(spec, made)
    return study, journal


def distributions(spec: SweepSpec) -> dict[str, optuna.distributions.BaseDistribution]:
    return {path: sweep_spec.distribution(param) for path, param in spec.space.items()}


def ask(study: optuna.Study, spec: SweepSpec) -> tuple[int, dict[str, Any]]:
    """A new trial's number and parameters, define-by-run: the unconditional parameters, then each
    conditional one only where its condition holds (absent from the trial otherwise, for Optuna and
    for the run: its spec keeps the base's value, or the default of the kind its condition chose)."""
    dists = distributions(spec)
    fixed = {path: dists[path] for path, param in spec.space.items() if param.when is None}
    trial = study.ask(fixed)
    params = dict(trial.params)
    for path, param in spec.space.items():
        if param.when is not None and sweep_spec.condition_holds(param, params):
            params[path] = _suggest(trial, path, dists[path])
    return trial.number, {path: params[path] for path in spec.space if path in params}


def _suggest(trial: optuna.Trial, name: str, dist: optuna.distributions.BaseDistribution) -> Any:
    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    assert isinstance(dist, CategoricalDistribution)
    return trial.suggest_categorical(name, dist.choices)  # type: ignore[arg-type]


IMPORTANCE_EVALUATOR = "ped-anova"


def importance(spec: SweepSpec, trials: Iterable[tuple[dict[str, Any], float]]) -> dict[str, float]:
    """Each parameter's importance to the objective over the complete trials ``(params, value)``,
    by Optuna's PED-ANOVA (``PedAnovaImportanceEvaluator``): numpy only. Optuna's default, fANOVA,
    and MeanDecreaseImpurity both need scikit-learn, which torchyard does not install (a large
    dependency for one figure). The trials are told to an in-memory study built from the sweep's
    own rows, not the journal replayed (that replays every reported step of every trial, on each
    read of a page that polls). Fewer than two complete trials: every parameter 0."""
    dists = distributions(spec)
    study = optuna.create_study(direction=spec.objective.direction)
    always = {path for path, param in spec.space.items() if param.when is None}
    for params, value in trials:
        kept = {p: v for p, v in params.items() if p in dists}
        if not always <= set(kept):
            continue  # a trial of another space (the spec cannot change; defensive)
        try:
            # A conditional parameter only where the trial has it: PED-ANOVA weighs it over the
            # trials that have it.
            frozen = optuna.trial.create_trial(params=kept, distributions={p: dists[p] for p in kept}, value=value)
        except ValueError:
            continue  # a value outside its distribution: left out rather than a 500
        study.add_trial(frozen)
    if len(study.trials) < 2:
        return {path: 0.0 for path in spec.space}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "too few trials" and experimental-API notices
        got = optuna.importance.get_param_importances(study, evaluator=PedAnovaImportanceEvaluator())
    return {path: float(got.get(path, 0.0)) for path in spec.space}
