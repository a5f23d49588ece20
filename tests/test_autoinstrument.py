"""An unmodified script's own collectives (``dist.all_reduce`` etc., FSDP2's all-gathers and
reduce-scatters) are timed and counted: 2 real Gloo ranks under torchrun, instrumented the way the
launcher instruments a script run (``workers/inject`` first on ``PYTHONPATH``), metrics read back
from the run's Redis stream (the SDK's real path)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis

from torchyard import streams
from torchyard.procs import RedisServer
from workers.code import INJECT_DIR

pytestmark = pytest.mark.timeout(180)
PROJECT_ROOT = Path(__file__).resolve().parent.parent

# The distributed tutorial's "manual averaging": no DDP, the script all-reduces its gradients itself.
MANUAL_AVERAGING = """
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 5))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(sys.argv[1])):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(20, 10)), torch.randn(20, 5))
    loss.backward()
    if step % 2:
        average_gradients(model)
    else:  # the overlapped variant: launch all, then wait
        works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
        for work in works:
            work.wait()
        for p in model.parameters():
            p.grad /= dist.get_world_size()
    optimizer.step()
dist.destroy_process_group()
"""

FSDP2 = """
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
fully_shard(model[0], mesh=mesh)
fully_shard(model[2], mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(sys.argv[1])):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 8))
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
"""

GRADIENT_BYTES = (10 * 64 + 64 + 64 * 5 + 5) * 4  # 4,116
UNIT_BYTES = ((16 * 32 + 32) * 4, (32 * 8 + 8) * 4)  # the two FSDP units' unsharded parameters


def run_script(tmp_path: Path, source: str, steps: int) -> dict[tuple[int, int], dict[str, float]]:
    """Runs ``source`` as torchrun would on 2 Gloo ranks, instrumented; returns {(rank, step): metrics}."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    server = RedisServer(tmp_path / "redis").start()
    try:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")},
            "PYTHONPATH": os.pathsep.join((str(INJECT_DIR), str(PROJECT_ROOT))),
            "TORCHYARD_INSTRUMENT": "1",
            "TORCHYARD_REDIS_URL": server.url,
            "TORCHYARD_RUN_ID": "7",
            "OMP_NUM_THREADS": "1",
        }
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(script),
                str(steps),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "instrumentation failed" not in done.stderr, done.stderr[-3000:]
        points: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
        client = redis.Redis.from_url(server.url)
        entries: Any = client.xrange(streams.run_stream(7))
        for _, fields in entries:
            kind, entry = streams.decode(fields)
            if kind == streams.METRICS:
                for step, _, values in entry["points"]:
                    points[(entry["rank"], step)].update(values)
        client.close()
        return dict(points)
    finally:
        server.stop()


def test_manual_all_reduce_of_gradients_is_timed_and_counted(tmp_path: Path) -> None:
    steps = 8
    points = run_script(tmp_path, MANUAL_AVERAGING, steps)
    assert {(rank, step) for rank in (0, 1) for step in range(1, steps + 1)} <= set(points)
    for (rank, step), metrics in sorted(points.items()):
        assert metrics["comm_bytes"] == GRADIENT_BYTES, (rank, step, metrics)
        assert 0 < metrics["comm_time_s"] < metrics["step_time_s"], (rank, step, metrics)
        assert 0 < metrics["exposed_comm_s"] <= metrics["comm_time_s"], (rank, step, metrics)
        assert metrics["algbw_GBps"] == pytest.approx(GRADIENT_BYTES / metrics["comm_time_s"] / 1e9)
        assert metrics["busbw_GBps"] == pytest.approx(metrics["algbw_GBps"])  # all-reduce on 2 ranks: ×1
        assert metrics["compute_time_s"] == pytest.approx(metrics["step_time_s"] - metrics["exposed_comm_s"])


def test_fsdp2_all_gathers_and_reduce_scatters_are_timed_and_counted(tmp_path: Path) -> None:
    steps = 6
    points = run_script(tmp_path, FSDP2, steps)
    assert {(rank, step) for rank in (0, 1) for step in range(1, steps + 1)} <= set(points)
    for (rank, step), metrics in points.items():
        # each unit: all-gathered (the whole unsharded buffer) for forward and again for backward
        # (reshard_after_forward), its gradients reduce-scattered (the whole unsharded input buffer)
        assert metrics["comm_bytes"] == 3 * sum(UNIT_BYTES), (rank, step, metrics)
        assert metrics["comm_time_s"] > 0 and metrics["busbw_GBps"] > 0, (rank, step, metrics)
        assert 0 < metrics["exposed_comm_s"] <= metrics["comm_time_s"], (rank, step, metrics)
