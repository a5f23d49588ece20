"""Checkpoints: a run resumed from its last complete checkpoint computes exactly what the
uninterrupted run computes; a torn or unfinished checkpoint is never used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_runtime import losses, points, server, spec, torchrun
from workers.runtime.checkpoint import COMPLETE, latest

pytestmark = pytest.mark.timeout(180)
__all__ = ["server"]  # the module-scoped Redis fixture, shared with test_runtime


def mlp_spec(steps: int) -> dict:
    s = spec({"kind": "builtin", "name": "mlp", "params": {"hidden": 32}}, steps=steps)
    s["training"]["checkpoint_every"] = 10
    return s


def test_a_resumed_run_computes_what_the_uninterrupted_run_computes(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ref_id, ref = torchrun(server, mlp_spec(30), env_extra={"TORCHYARD_CHECKPOINT_DIR": str(tmp_path / "ref")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = losses(points(server, ref_id))

    # An attempt that ends at step 20 (as if its node died there) leaves the step-10 checkpoint...
    _first_id, first = torchrun(server, mlp_spec(20), env_extra={"TORCHYARD_CHECKPOINT_DIR": str(tmp_path / "run")})
    assert first.returncode == 0, first.stderr[-3000:]
    assert latest(tmp_path / "run") == (10, tmp_path / "run" / "step-10")
    # ... and the next attempt of the 30-step run resumes from it, replaying steps 11-20.
    second_id, second = torchrun(server, mlp_spec(30), env_extra={"TORCHYARD_CHECKPOINT_DIR": str(tmp_path / "run")})
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from the checkpoint at step 10" in second.stdout + second.stderr
    resumed = losses(points(server, second_id))
    assert {step for _rank, step in resumed} == set(range(11, 31)), "only the steps after the checkpoint run"
    for key, value in resumed.items():
        assert value == pytest.approx(reference[key], rel=1e-6, abs=1e-7), f"rank/step {key} differs after resume"
    assert latest(tmp_path / "run")[0] == 20  # type: ignore[index]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-10", "step-20"]


def test_only_a_complete_checkpoint_counts(tmp_path: Path) -> None:
    assert latest(tmp_path / "missing") is None
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / COMPLETE).write_text("10")
    (tmp_path / ".step-30.partial").mkdir()  # a save that died before it was published
    (tmp_path / "step-20").mkdir()  # published by hand, never completed
    os.utime(tmp_path / "step-20")
    assert latest(tmp_path) == (10, tmp_path / "step-10")
