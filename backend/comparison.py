"""Strategy comparison: a run's workload, data, resources and training once per strategy that
applies to them, queued together, so their throughput, communication, memory and loss can be read
side by side (the compare page's summary) under the same cluster conditions."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from backend import errors
from torchyard.spec import RunSpec, ScriptConfig, strategy_kinds

NAME_MAX = 200  # RunSpec.name's bound


def variants(spec: RunSpec) -> tuple[list[RunSpec], list[dict[str, str]]]:
    """A spec per strategy kind (the run's own with its options, the others with their defaults),
    and the kinds that do not apply to it, each with the validation's reason."""
    if isinstance(spec.workload, ScriptConfig):
        raise errors.InvalidRequest(
            ["path", "run_id"],
            "a script run does its own parallelism: strategies are compared on a built-in workload (mlp, charlm)",
            spec.workload.entry,
        )
    base = spec.model_dump(mode="json")
    stem = spec.name or spec.default_name
    specs: list[RunSpec] = []
    skipped: list[dict[str, str]] = []
    for kind in strategy_kinds():
        strategy: dict[str, Any] = base["strategy"] if kind == spec.strategy.kind else {"kind": kind}
        suffix = f" · {kind}"
        try:
            specs.append(
                RunSpec.model_validate({**base, "strategy": strategy, "name": stem[: NAME_MAX - len(suffix)] + suffix})
            )
        except ValidationError as e:
            skipped.append({"strategy": kind, "reason": "; ".join(_reason(err) for err in e.errors())})
    return specs, skipped


def _reason(err: Any) -> str:
    message = str(err["msg"])
    return message.removeprefix("Value error, ")
