"""Checkpoints: a run resumed from its last complete checkpoint computes exactly what the
uninterrupted run computes; a torn or unfinished checkpoint is never used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli.redis_server import RedisServer
from testkit.forked import Forked
from testkit.torchrun import forked_run, losses, points, spec
from torchyard.checkpoints import COMPLETE
from workers.runtime.checkpoint import latest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def mlp_spec(steps: int, strategy: str, *, final: bool = True) -> dict:
    s = spec({"kind": "builtin", "name": "mlp", "params": {"hidden": 32}}, steps=steps)
    s["strategy"] = {"kind": strategy}
    s["training"].update(checkpoint_every=10, checkpoint_final=final)
    return s


# FSDP: sharded parameters and optimizer state; async: the server's alone (one worker: deterministic)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "async"])
def test_a_resumed_run_computes_what_the_uninterrupted_run_computes(
    forked: Forked, server: RedisServer, tmp_path: Path, strategy: str
) -> None:
    def attempt(steps: int, folder: str, *, final: bool = True) -> tuple[int, str]:
        env = {"TORCHYARD_CHECKPOINT_DIR": str(tmp_path / folder)}
        return forked_run(forked, server, mlp_spec(steps, strategy, final=final), tmp_path / "logs", env_extra=env)

    ref_id, _ = attempt(30, "ref")
    reference = losses(points(server, ref_id))

    # An attempt that ends at step 20 (as if its node died there; no final save) leaves the step-10
    # checkpoint...
    attempt(20, "run", final=False)
    assert latest(tmp_path / "run") == (10, tmp_path / "run" / "step-10")
    # ... and the next attempt of the 30-step run resumes from it, replaying steps 11-20.
    second_id, second = attempt(30, "run")
    assert "resumed from the checkpoint at step 10" in second
    resumed = losses(points(server, second_id))
    assert {step for _rank, step in resumed} == set(range(11, 31)), "only the steps after the checkpoint run"
    for key, value in resumed.items():
        assert value == pytest.approx(reference[key], rel=1e-6, abs=1e-7), f"rank/step {key} differs after resume"
    # It saved at 20 and at its last step, 30 (the final weights); the newest two are kept.
    assert latest(tmp_path / "run")[0] == 30  # type: ignore[index]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-20", "step-30"]
    assert "final checkpoint saved at step 30" in second


def test_only_a_complete_checkpoint_counts(tmp_path: Path) -> None:
    assert latest(tmp_path / "missing") is None
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / COMPLETE).write_text("10")
    (tmp_path / ".step-30.partial").mkdir()  # a save that died before it was published
    (tmp_path / "step-20").mkdir()  # published by hand, never completed
    os.utime(tmp_path / "step-20")
    assert latest(tmp_path) == (10, tmp_path / "step-10")
