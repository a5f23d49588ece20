"""The rank entrypoint under the real torch elastic launcher, 2 ranks on Gloo, metrics into a
private redis-server."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from torchyard import streams
from torchyard.procs import RedisServer

ROOT = Path(__file__).resolve().parents[1]
_run_ids = iter(range(100, 10_000))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


def torchrun(
    server: RedisServer, spec: dict[str, Any], timeout: float = 60, env_extra: dict[str, str] | None = None
) -> tuple[int, subprocess.CompletedProcess[str]]:
    run_id = next(_run_ids)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(
        TORCHYARD_SPEC=json.dumps(spec),
        TORCHYARD_REDIS_URL=server.url,
        TORCHYARD_RUN_ID=str(run_id),
        TORCHYARD_ATTEMPT="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        **(env_extra or {}),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(spec["resources"]["procs_per_node"]), "-m", "workers.runtime.train"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return run_id, proc


def points(server: RedisServer, run_id: int) -> list[tuple[int, int, dict[str, float]]]:
    """(rank, step, values) of every metrics point, in stream order."""
    client = redis.Redis.from_url(server.url)
    try:
        out = []
        entries: Any = client.xrange(streams.run_stream(run_id))
        for _id, fields in entries:
            kind, data = streams.decode(fields)
            assert kind == streams.METRICS and data["attempt"] == 1 and data["dropped"] == 0
            out += [(data["rank"], step, values) for step, _ts, values in data["points"]]
        return out
    finally:
        client.close()


def spec(workload: dict[str, Any], steps: int, seed: int = 0, batch_size: int = 64) -> dict[str, Any]:
    return {
        "name": "test",
        "workload": workload,
        "strategy": {"kind": "ddp"},
        "resources": {"procs_per_node": 2, "device": "cpu"},
        "training": {"steps": steps, "batch_size": batch_size, "lr": 0.01, "seed": seed, "log_every": 1},
    }


def losses(pts: list[tuple[int, int, dict[str, float]]]) -> dict[tuple[int, int], float]:
    return {(rank, step): values["loss"] for rank, step, values in pts}


MLP = {"name": "mlp", "params": {"samples": 4096}}
BASE_KEYS = {"loss", "lr", "step_time_s", "samples_per_s", "data_time_s"}
COMM_KEYS = {
    "compute_time_s", "comm_time_s", "exposed_comm_s", "comm_fraction", "comm_bytes",
    "algbw_GBps", "busbw_GBps", "busbw_efficiency", "max_rss_bytes",
}  # fmt: skip


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
        assert set(values) == BASE_KEYS | COMM_KEYS
        assert values["lr"] == 0.01 and values["step_time_s"] > 0 and values["data_time_s"] >= 0
        assert values["samples_per_s"] == pytest.approx(32 / values["step_time_s"])
    by_step = losses(pts)
    for rank in (0, 1):
        series = [by_step[(rank, s)] for s in range(1, 31)]
        assert sum(series[-5:]) / 5 < sum(series[:5]) / 5, series
    assert "step 30/30 loss" in proc.stdout and "step 3/30 loss" in proc.stdout


@pytest.mark.timeout(90)
def test_same_seed_gives_identical_losses(server: RedisServer, mlp_run: Any) -> None:
    first_id, _ = mlp_run
    second_id, proc = torchrun(server, spec(MLP, 30, seed=7))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, second = losses(points(server, first_id)), losses(points(server, second_id))
    assert len(first) == 60 and first == second
    assert first[(0, 1)] != first[(1, 1)]  # the ranks really saw different shards


@pytest.mark.timeout(90)
def test_failing_workload_exits_non_zero_with_its_error(server: RedisServer) -> None:
    run_id, proc = torchrun(server, spec({"name": "fail", "params": {"at_step": 3}}, 10))
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "RuntimeError: workload 'fail' raised at step 3" in output
    assert "ChildFailedError" in output  # torchrun's summary, with the rank's traceback (@record)
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
