"""A sweep as a user submits it (``POST /api/v1/sweeps``): a base run spec, a search space over
its paths, the objective, the budget, the sampler and the pruner. Checked before anything starts:
a path the spec does not have, an empty range, a type the field cannot take, or a value that makes
the base spec invalid is a 422 naming the parameter and the value.

A parameter may be conditional (``when``): asked only in the trials where categorical parameters of
the same space took one of the listed values, e.g. ``strategy.comm_hook`` only where
``strategy.kind`` is ``ddp``. Optuna's define-by-run asks it only then; TPE (independent, as
torchyard's is) and random sampling model such a space as it is, CMA-ES samples the conditional
ones at random, and the grid cannot have one (a 422)."""

from __future__ import annotations

import copy
import math
from typing import Annotated, Any, Literal

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from backend import admission
from backend.errors import InvalidRequest
from backend.models import Token
from torchyard.spec import MAX_STEPS, RunSpec
from torchyard.streams import MAX_KEY_CHARS

MAX_PARAMS = 32
MAX_TRIALS = 10_000
MAX_CHOICES = 256
MAX_GRID = 100_000  # a grid parameter's points, at most
# Setting one of these picks another model of a union: the object is replaced by one with only it
# (the new kind's defaults), before any deeper path of the space is set.
DISCRIMINATORS = {"strategy.kind": {}, "workload.name": {"kind": "builtin"}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


Choice = Annotated[str, Field(max_length=200)] | bool | int | float


class _Param(_Strict):
    when: dict[Annotated[str, Field(min_length=1, max_length=200)], list[Choice]] | None = Field(
        None,
        min_length=1,
        max_length=MAX_PARAMS,
        description="asked only in trials where each named categorical parameter of the space took one of "
        "its listed values, e.g. {'strategy.kind': ['ddp']} (default: in every trial)",
    )


class FloatParam(_Param):
    """Uniform over [low, high], or log-uniform (``log``), or on a grid of ``step``."""

    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    step: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _range(self) -> FloatParam:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low:g}) must be less than high ({self.high:g}): the range is empty")
        if self.log and self.low <= 0:
            raise ValueError(f"low ({self.low:g}) must be > 0 for a log-uniform range")
        if self.log and self.step is not None:
            raise ValueError(f"log (true) and step ({self.step:g}) exclude each other")
        return self


class IntParam(_Param):
    """An integer in [low, high] on a grid of ``step`` (64…1024 step 64), or log-uniform."""

    type: Literal["int"]
    low: int = Field(..., ge=-(2**53), le=2**53)
    high: int = Field(..., ge=-(2**53), le=2**53)
    step: int = Field(1, ge=1, le=2**53)
    log: bool = False

    @model_validator(mode="after")
    def _range(self) -> IntParam:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be less than high ({self.high}): the range is empty")
        if self.step > self.high - self.low:
            raise ValueError(f"step ({self.step}) is wider than the range {self.low}…{self.high}: one value only")
        if self.log and (self.low < 1 or self.step != 1):
            raise ValueError(f"a log range needs low ≥ 1 (got {self.low}) and step 1 (got {self.step})")
        return self


class CategoricalParam(_Param):
    type: Literal["categorical"]
    choices: list[Choice] = Field(..., min_length=1, max_length=MAX_CHOICES)

    @model_validator(mode="after")
    def _distinct(self) -> CategoricalParam:
        seen = [repr(c) for c in self.choices]
        if len(set(seen)) != len(seen):
            raise ValueError(f"choices ({', '.join(seen)}) repeat a value")
        return self


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class Objective(_Strict):
    metric: str = Field("loss", min_length=1, max_length=MAX_KEY_CHARS, description="a metric key the ranks log")
    direction: Literal["minimize", "maximize"] = "minimize"
    take: Literal["last", "best", "mean_last_k"] = Field(
        "last", description="a run's value: its last step's, its best step's, or the mean of its last k steps'"
    )
    k: int = Field(5, ge=1, le=MAX_STEPS, description="steps averaged by take 'mean_last_k'")


class AshaPruner(_Strict):
    """Asynchronous successive halving: at each rung (min_steps × reduction_factor^n steps) a trial
    goes on only if it is in the best 1/reduction_factor of the trials that reached that rung."""

    kind: Literal["asha"]
    min_steps: int = Field(1, ge=1, le=MAX_STEPS, description="the first rung")
    reduction_factor: int = Field(3, ge=2, le=100)


class MedianPruner(_Strict):
    """Stops a trial whose value is worse than the median of earlier trials at the same step."""

    kind: Literal["median"]
    startup_trials: int = Field(2, ge=0, le=MAX_TRIALS, description="trials that finish before any is pruned")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="steps of a trial before it may be pruned")


class NoPruner(_Strict):
    kind: Literal["none"]


Pruner = Annotated[AshaPruner | MedianPruner | NoPruner, Field(discriminator="kind")]


class SweepSpec(_Strict):
    name: str | None = Field(None, min_length=1, max_length=150, description="default: the base spec's name")
    base: RunSpec = Field(..., description="the run every trial starts from")
    space: dict[Annotated[str, Field(min_length=1, max_length=200)], Param] = Field(
        ...,
        min_length=1,
        max_length=MAX_PARAMS,
        description="spec path → distribution, e.g. {'training.lr': {'type': 'float', 'low': 1e-4, 'high': 0.1, "
        "'log': true}}",
    )
    objective: Objective = Objective()
    n_trials: int = Field(10, ge=1, le=MAX_TRIALS)
    max_concurrent: int = Field(1, ge=1, le=256, description="trials whose runs are unfinished at once, at most")
    sampler: Literal["tpe", "random", "grid", "cmaes"] = "tpe"
    pruner: Pruner = AshaPruner(kind="asha")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="the sampler's seed (default: random)")


def check_space(spec: SweepSpec, owner: Token | None = None, max_member_priority: int | None = None) -> None:
    """Every path names a field of the base spec that the parameter's values fit: the bounds and each
    choice, set alone into the base spec, must give a valid spec and one ``owner`` may submit (the
    rules of ``runs.create_run``: a member's priority bound); InvalidRequest names the first that
    does not. Values that only clash together are found per trial (that trial fails)."""
    base = spec.base.model_dump(mode="json")
    admission.check_priority(
        spec.base.resources.priority, owner, max_member_priority, ["body", "base", "resources", "priority"]
    )
    _check_conditions(spec)
    # Unconditional parameters first: a condition's contexts below set them.
    for path, param in sorted(spec.space.items(), key=lambda item: item[1].when is not None):
        loc: list[str | int] = ["body", "space", path]
        for context in _contexts(param):
            on = "" if not context else " where " + ", ".join(f"{p} = {v!r}" for p, v in context.items())
            try:
                where_base = RunSpec.model_validate(spec_with(base, context)) if context else spec.base
            except ValidationError:
                continue  # the condition's own value makes the base invalid: its parameter's probe says so
            field = _field(where_base, path, loc, on)
            if isinstance(param, FloatParam) and _is_int_field(field):
                raise InvalidRequest(loc, f"space[{path!r}] is a float parameter but {path} takes integers", path)
            for value in _probes(param):
                try:
                    probe = RunSpec.model_validate(spec_with(base, {**context, path: value}))
                except ValidationError as exc:
                    first = exc.errors()[0]
                    where = ".".join(str(p) for p in first["loc"]) or path
                    raise InvalidRequest(
                        loc,
                        f"space[{path!r}]: {path} = {value!r}{on} makes the base spec invalid: {where}: {first['msg']}",
                        value,
                    ) from None
                admission.check_priority(
                    probe.resources.priority, owner, max_member_priority, loc, f"space[{path!r}]: resources.priority"
                )
    if spec.sampler == "grid":
        points = 1
        for path, param in spec.space.items():
            if param.when is not None:
                raise InvalidRequest(
                    ["body", "space", path, "when"],
                    f"sampler 'grid' cannot have a conditional parameter (space[{path!r}] has when): a grid is "
                    "every combination of every parameter; use tpe or random",
                    path,
                )
            if isinstance(param, FloatParam) and param.step is None:
                raise InvalidRequest(
                    ["body", "space", path], f"sampler 'grid' needs a step (or choices) for space[{path!r}]", path
                )
            points *= len(grid_values(param))
        if spec.n_trials > points:
            raise InvalidRequest(
                ["body", "n_trials"],
                f"n_trials ({spec.n_trials}) is more than the grid's {points} points",
                spec.n_trials,
            )


def same_choice(a: Any, b: Any) -> bool:
    """Equal and of one type: True is not the choice 1, nor 1 the choice 1.0."""
    return type(a) is type(b) and a == b


def condition_holds(param: FloatParam | IntParam | CategoricalParam, params: dict[str, Any]) -> bool:
    """Whether a trial whose parameters so far are ``params`` asks ``param``."""
    return param.when is None or all(
        parent in params and any(same_choice(params[parent], v) for v in values)
        for parent, values in param.when.items()
    )


def _check_conditions(spec: SweepSpec) -> None:
    """Each ``when`` names another categorical, unconditional parameter of the space and some of its
    choices."""
    for path, param in spec.space.items():
        for parent, values in (param.when or {}).items():
            loc: list[str | int] = ["body", "space", path, "when", parent]
            named = spec.space.get(parent)
            if parent == path:
                raise InvalidRequest(loc, f"space[{path!r}].when names {path} itself", parent)
            if named is None:
                raise InvalidRequest(
                    loc,
                    f"space[{path!r}].when names {parent}, which is not a parameter of the space "
                    f"(it has: {', '.join(spec.space)})",
                    parent,
                )
            if not isinstance(named, CategoricalParam):
                raise InvalidRequest(
                    loc,
                    f"space[{path!r}].when names {parent}, a {named.type} parameter: a condition is on a "
                    "categorical one",
                    parent,
                )
            if named.when is not None:
                raise InvalidRequest(
                    loc,
                    f"space[{path!r}].when names {parent}, which is itself conditional: a condition is on an "
                    "unconditional parameter",
                    parent,
                )
            if not values:
                raise InvalidRequest(loc, f"space[{path!r}].when[{parent!r}] lists no value", parent)
            for value in values:
                if not any(same_choice(value, c) for c in named.choices):
                    raise InvalidRequest(
                        loc,
                        f"space[{path!r}].when[{parent!r}]: {value!r} is not among {parent}'s choices "
                        f"({', '.join(repr(c) for c in named.choices)})",
                        value,
                    )


def _contexts(param: FloatParam | IntParam | CategoricalParam) -> list[dict[str, Any]]:
    """The parent values a conditional parameter is checked under: each allowed value of each
    parent, the other parents at their first (linear, not every combination)."""
    if param.when is None:
        return [{}]
    first = {parent: values[0] for parent, values in param.when.items()}
    contexts = [first]
    for parent, values in param.when.items():
        contexts += [{**first, parent: v} for v in values[1:]]
    return contexts


def _field(base: RunSpec, path: str, loc: list[str | int], on: str = "") -> Any:
    node: Any = base
    parts = path.split(".")
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the spec"
        if not isinstance(node, BaseModel):
            raise InvalidRequest(
                loc, f"space[{path!r}]: {where} is not set in the base spec{on}, it has no {part}", path
            )
        fields = type(node).model_fields
        if part not in fields:
            raise InvalidRequest(
                loc,
                f"space[{path!r}]: the base spec{on} has no field {path} ({where} has: {', '.join(fields)})",
                path,
            )
        if i == len(parts) - 1:
            if isinstance(getattr(node, part), BaseModel):
                raise InvalidRequest(loc, f"space[{path!r}]: {path} is an object: name one of its fields", path)
            return fields[part]
        node = getattr(node, part)
    raise AssertionError("unreachable")


def _is_int_field(field: Any) -> bool:
    annotation = field.annotation
    return annotation is int or (getattr(annotation, "__args__", None) or (None,))[0] is int


def _probes(param: FloatParam | IntParam | CategoricalParam) -> list[Any]:
    if isinstance(param, CategoricalParam):
        return list(param.choices)
    return [param.low, param.high]


def grid_values(param: FloatParam | IntParam | CategoricalParam) -> list[Any]:
    if isinstance(param, CategoricalParam):
        return list(param.choices)
    step = param.step or 1
    span = (param.high - param.low) / step
    count = MAX_GRID if not math.isfinite(span) or span >= MAX_GRID else math.floor(span + 1e-9) + 1
    return [param.low + i * step for i in range(count)]


def distribution(param: FloatParam | IntParam | CategoricalParam) -> BaseDistribution:
    if isinstance(param, FloatParam):
        return FloatDistribution(param.low, param.high, log=param.log, step=param.step)
    if isinstance(param, IntParam):
        high = param.low + (param.high - param.low) // param.step * param.step
        return IntDistribution(param.low, high, log=param.log, step=param.step)
    return CategoricalDistribution(tuple(param.choices))


def spec_with(base: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The base spec (as JSON) with each path set to its value, shallower paths first: setting a
    strategy's kind or a workload's name starts that object afresh (its defaults)."""
    spec = copy.deepcopy(base)
    for path in sorted(params, key=lambda p: p.count(".")):
        *parents, leaf = path.split(".")
        node = spec
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if path in DISCRIMINATORS:
            node.clear()
            node.update(DISCRIMINATORS[path])
        node[leaf] = params[path]
    return spec
