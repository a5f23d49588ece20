"""The rank entrypoint under the real torch elastic launcher, 2 ranks on Gloo, metrics into a
private redis-server; and the same ranks forked from a warm process (testkit/forked.py)."""

from __future__ import annotations

import math
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cli.redis_server import RedisServer
from testkit.forked import Forked
from testkit.torchrun import BASE_KEYS, COMM_KEYS, forked_run, losses, points, spec, torchrun

pytestmark = pytest.mark.dist

MLP = {"name": "mlp", "params": {"samples": 4096}}


@pytest.fixture(scope="module")
def mlp_run(server: RedisServer) -> tuple[int, subprocess.CompletedProcess[str]]:
    return torchrun(server, spec(MLP, 30, seed=7))


@pytest.mark.timeout(90)
def test_mlp_logs_every_step_of_every_rank_once_and_learns(server: RedisServer, mlp_run: Any) -> None:
    run_id, proc = mlp_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pts = points(server, run_id)
    assert Counter((rank, step) for rank, step, _ in pts) == Counter({(r, s): 1 for r in (0, 1) for s in range(1, 31)})
    for _rank, _step, values in pts:
        assert set(values) == BASE_KEYS | COMM_KEYS | {"comm_bytes_all_reduce"}  # DDP's only kind
        assert values["lr"] == 0.01 and values["step_time_s"] > 0 and values["data_time_s"] >= 0
        assert values["samples_per_s"] == pytest.approx(32 / values["step_time_s"])
    by_step = losses(pts)
    for rank in (0, 1):
        series = [by_step[(rank, s)] for s in range(1, 31)]
        assert sum(series[-5:]) / 5 < sum(series[:5]) / 5, series
    assert "step 30/30 loss" in proc.stdout and "step 3/30 loss" in proc.stdout


@pytest.mark.timeout(90)
def test_same_seed_gives_identical_losses_under_torchrun_and_forked_from_a_warm_process(
    server: RedisServer, mlp_run: Any, forked: Forked, tmp_path: Path
) -> None:
    """The same ranks either way: the modules that compare strategies fork theirs (testkit/forked.py)."""
    first_id, _ = mlp_run
    second_id, _output = forked_run(forked, server, spec(MLP, 30, seed=7), tmp_path)
    first, second = losses(points(server, first_id)), losses(points(server, second_id))
    assert len(first) == 60 and first == second
    assert first[(0, 1)] != first[(1, 1)]  # the ranks really saw different shards


@pytest.mark.timeout(90)
def test_a_forked_gang_ends_when_one_rank_fails_and_says_why(
    server: RedisServer, forked: Forked, tmp_path: Path
) -> None:
    """As under torchrun: rank 1 raises at step 3; rank 0, waiting in that step's all-reduce, ends
    too (Gloo's error on the closed connection, or else the SIGTERM its gang gets) instead of
    waiting for ever; the failure quotes rank 1's traceback."""
    with pytest.raises(AssertionError) as failed:
        forked_run(
            forked, server, spec({"name": "fail", "params": {"at_step": 3, "rank": 1}}, 10), tmp_path, timeout=60
        )
    assert any(f"ranks ended [{rank_0}, 1]" in str(failed.value) for rank_0 in (1, 143)), str(failed.value)
    assert "RuntimeError: workload 'fail' raised at step 3" in str(failed.value)


@pytest.mark.timeout(90)
def test_failing_workload_exits_non_zero_with_its_error(server: RedisServer) -> None:
    run_id, proc = torchrun(server, spec({"name": "fail", "params": {"at_step": 3}}, 10))
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "RuntimeError: workload 'fail' raised at step 3" in output
    assert "ChildFailedError" in output  # torchrun's summary, with the rank's traceback (its error file)
    # the steps before the failure were still delivered (the exit handler flushes)
    assert {(rank, step) for rank, step, _ in points(server, run_id)} == {(r, s) for r in (0, 1) for s in (1, 2)}


@pytest.mark.timeout(90)
def test_charlm_runs_and_logs_finite_loss(server: RedisServer) -> None:
    workload = {
        "name": "charlm",
        "params": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32, "corpus_bytes": 200_000},
    }
    run_id, proc = torchrun(server, spec(workload, 5, batch_size=16))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pts = points(server, run_id)
    assert {(rank, step) for rank, step, _ in pts} == {(r, s) for r in (0, 1) for s in range(1, 6)}
    for _rank, _step, values in pts:
        assert math.isfinite(values["loss"]) and 0 < values["loss"] < 10
        assert values["tokens_per_s"] == pytest.approx(values["samples_per_s"] * 32)


@pytest.mark.timeout(90)
def test_a_one_rank_run_logs_no_comm_figures(server: RedisServer) -> None:
    """DDP on a group of one still "all-reduces" (a copy): nothing crosses a wire, so nothing of
    communication is reported, and the step's time is all compute and data."""
    one = spec(MLP, 5)
    one["resources"]["procs_per_node"] = 1
    run_id, proc = torchrun(server, one)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pts = points(server, run_id)
    assert {(rank, step) for rank, step, _ in pts} == {(0, s) for s in range(1, 6)}
    memory = {"max_rss_bytes", "param_bytes", "optimizer_state_bytes"}
    for _rank, _step, values in pts:
        assert set(values) == BASE_KEYS | memory, set(values) ^ (BASE_KEYS | memory)
