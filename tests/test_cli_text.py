"""What the CLI prints, from the api's answers as they come (no process needed)."""

from __future__ import annotations

from typing import Any

from cli.runs import step_of


def listed(kind: str, step: int, steps: int) -> dict[str, Any]:
    return {"last_step": step, "spec": {"workload": {"kind": kind}, "training": {"steps": steps}}}


def test_a_scripts_steps_past_what_its_user_expected_show_alone() -> None:
    assert step_of(listed("script", 421, 100)) == "421"  # was "421/100": the 100 was only a guess
    assert step_of(listed("script", 42, 100)) == "42/100"
    assert step_of(listed("builtin", 42, 100)) == "42/100"  # a built-in stops at its steps
