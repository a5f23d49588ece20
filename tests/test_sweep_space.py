"""A sweep's space checked and asked in-process, without a stack: a conditional parameter must name
a categorical parameter of the space and its choices (a 422 naming it); Optuna asks a conditional
parameter only where its condition holds, and TPE learns such a space; CMA-ES asks within the space
and moves towards the best values."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest

from backend import sweep_study
from backend.errors import InvalidRequest
from backend.sweep_spec import SweepSpec, check_space, spec_with
from testkit.stack import sweep_spec
from torchyard.spec import RunSpec

pytestmark = pytest.mark.timeout(120)


def conditional_spec(**overrides: Any) -> dict[str, Any]:
    """DDP's gradient hook, asked only in the trials that picked DDP (local SGD has none)."""
    space = {
        "strategy.kind": {"type": "categorical", "choices": ["ddp", "local_sgd"]},
        "strategy.comm_hook": {
            "type": "categorical",
            "choices": ["allreduce", "fp16"],
            "when": {"strategy.kind": ["ddp"]},
        },
        "strategy.period": {"type": "int", "low": 2, "high": 8, "when": {"strategy.kind": ["local_sgd"]}},
        "training.lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True},
    }
    return sweep_spec(**{"space": space, "sampler": "tpe", **overrides})


def refused(spec: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as got:
        check_space(SweepSpec.model_validate(spec))
    return got.value


@pytest.mark.timeout(30)
def test_a_conditional_parameter_must_name_a_categorical_parameter_of_the_space_and_its_choices() -> None:
    check_space(SweepSpec.model_validate(conditional_spec()))  # checked under the kind its condition picks
    cases: list[tuple[str, dict[str, Any], list[Any], str]] = [
        ("strategy.comm_hook", {"strategy.kindd": ["ddp"]}, ["strategy.kindd"], "not a parameter of the space"),
        ("strategy.comm_hook", {"training.lr": [0.01]}, ["training.lr"], "a float parameter"),
        ("strategy.comm_hook", {"strategy.kind": ["ddp", "zero"]}, ["strategy.kind"], "'zero' is not among"),
        ("strategy.comm_hook", {"strategy.kind": []}, ["strategy.kind"], "lists no value"),
        ("strategy.comm_hook", {"strategy.comm_hook": ["fp16"]}, ["strategy.comm_hook"], "itself"),
        ("strategy.period", {"strategy.comm_hook": ["fp16"]}, ["strategy.comm_hook"], "itself conditional"),
        # local SGD has no gradient hook: the path is checked where its condition holds
        ("strategy.comm_hook", {"strategy.kind": ["local_sgd"]}, [], "where strategy.kind = 'local_sgd' has no field"),
    ]
    for path, when, loc_tail, words in cases:
        spec = conditional_spec()
        spec["space"][path]["when"] = when
        error = refused(spec)
        assert error.loc == ["body", "space", path, *(["when", *loc_tail] if loc_tail else [])], (when, error.loc)
        assert path in error.msg and words in error.msg, (when, error.msg)
    spec = conditional_spec()
    spec["space"]["strategy.comm_hook"]["when"] = {"strategy.kind": [True]}  # a bool is not the choice "ddp"
    assert "True is not among" in refused(spec).msg
    spec = conditional_spec(sampler="grid")
    spec["space"]["training.lr"] = {"type": "float", "low": 0.01, "high": 0.05, "step": 0.01}
    error = refused(spec)
    assert error.loc[:3] == ["body", "space", "strategy.comm_hook"] and "grid' cannot have a conditional" in error.msg


@pytest.mark.timeout(60)
def test_optuna_asks_a_conditional_parameter_only_where_its_condition_holds() -> None:
    import optuna

    spec = SweepSpec.model_validate(conditional_spec(n_trials=40, seed=3))
    check_space(spec)
    study = optuna.create_study(sampler=sweep_study.sampler(spec))  # TPE after its random start-up trials
    kinds = []
    for _ in range(spec.n_trials):
        number, params = sweep_study.ask(study, spec)
        kind = params["strategy.kind"]
        kinds.append(kind)
        assert ("strategy.comm_hook" in params) == (kind == "ddp"), params
        assert ("strategy.period" in params) == (kind == "local_sgd"), params
        assert set(study.trials[number].params) == set(params), "Optuna holds what the trial was given"
        run = RunSpec.model_validate(spec_with(spec.base.model_dump(mode="json"), params))
        assert run.strategy.kind == kind, "every trial's parameters make a valid run spec"
        # the objective favours local SGD with a long period: TPE learns a conditional space
        study.tell(number, params["training.lr"] + (1 / params["strategy.period"] if kind == "local_sgd" else 1.0))
    assert {"ddp", "local_sgd"} == set(kinds)
    assert kinds[-10:].count("local_sgd") >= 7, kinds
    got = sweep_study.importance(spec, [(t.params, t.value) for t in study.trials if t.value is not None])
    # weighed over the trials that have it: period (the objective rewards a long one) above the hook
    assert set(got) == set(spec.space) and got["strategy.period"] > got["strategy.comm_hook"], got


def test_cmaes_asks_within_the_space_and_moves_towards_the_best_values() -> None:
    import optuna

    space = {
        "training.lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        "workload.params.hidden": {"type": "int", "low": 8, "high": 64, "step": 8},
    }
    spec = SweepSpec.model_validate({**conditional_spec(n_trials=30, seed=5), "space": space, "sampler": "cmaes"})
    check_space(spec)
    study = optuna.create_study(sampler=sweep_study.sampler(spec))
    for _ in range(spec.n_trials):
        number, params = sweep_study.ask(study, spec)
        lr, hidden = params["training.lr"], params["workload.params.hidden"]
        assert 1e-4 <= lr <= 1.0 and hidden in range(8, 65, 8), params
        study.tell(number, (math.log10(lr) + 2) ** 2 + ((hidden - 40) / 8) ** 2)  # best at lr 0.01, hidden 40
    assert type(study.sampler).__name__ == "CmaEsSampler"
    first, last = (statistics.fmean(t.value for t in part) for part in (study.trials[:10], study.trials[-10:]))
    assert last < first, f"CMA-ES's last 10 trials ({last:.2f}) no better than its first 10 ({first:.2f})"
