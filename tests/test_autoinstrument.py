"""An unmodified script's own collectives (``dist.all_reduce`` etc., FSDP2's all-gathers and
reduce-scatters, DTensor's functional collectives) are timed and counted: 2 real Gloo ranks under torchrun, instrumented the way the
launcher instruments a script run (``workers/inject`` first on ``PYTHONPATH``), metrics read back
from the run's Redis stream (the SDK's real path)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis

from cli.redis_server import RedisServer
from torchyard import streams
from workers.code import INJECT_DIR

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]
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


def mesh_script(imports: str, parallelize: str) -> str:
    """A two-layer MLP on a 1-D CPU mesh of every rank, parallelized by ``parallelize`` (lines of
    Python over ``model`` and ``mesh``), trained for ``argv[1]`` steps on random batches."""
    return f"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
{imports}

dist.init_process_group("gloo")
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
{parallelize}
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(sys.argv[1])):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 8))
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
"""


FSDP2 = mesh_script(
    "from torch.distributed.fsdp import fully_shard",
    "fully_shard(model[0], mesh=mesh)\nfully_shard(model[2], mesh=mesh)\nfully_shard(model, mesh=mesh)",
)

# Tensor parallelism (DTensor): its collectives never go through torch.distributed.*
TENSOR_PARALLEL = mesh_script(
    "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module",
    'parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})',
)

# Mixed precision's loss scaling and two micro-batches per step (their mean is the step's loss);
# from step 4 on, the script logs a loss of its own.
SCALED_ACCUMULATION = """
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
for step in range(1, int(sys.argv[1]) + 1):
    optimizer.zero_grad()
    micro = []
    for _ in range(2):
        loss = nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        micro.append(loss.item())
        scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    print(f"LOSS {dist.get_rank()} {step} {sum(micro) / 2!r}", flush=True)
    if step >= 4:
        import torchyard

        torchyard.log(step, loss=-1.0)
dist.destroy_process_group()
"""

GRADIENT_BYTES = (10 * 64 + 64 + 64 * 5 + 5) * 4  # 4,116
UNIT_BYTES = ((16 * 32 + 32) * 4, (32 * 8 + 8) * 4)  # the two FSDP units' unsharded parameters


class Ran(NamedTuple):
    points: dict[tuple[int, int], dict[str, float]]  # (rank, step) -> metrics
    losses: list[tuple[int, int, float]]  # every loss value in the stream, in order: (rank, step, value)
    stdout: str


def run_script(tmp_path: Path, source: str, steps: int) -> Ran:
    """Runs ``source`` as torchrun would on 2 Gloo ranks, instrumented, and reads its run stream."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    server = RedisServer(tmp_path / "redis").start()
    try:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")},
            "PYTHONPATH": os.pathsep.join((str(INJECT_DIR), str(PROJECT_ROOT))),
            "TORCHYARD_INSTRUMENT": "1",
            "TORCHYARD_RANK_REDIS_URL": server.url,
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
        losses = []
        client = redis.Redis.from_url(server.url)
        entries: Any = client.xrange(streams.rank_stream(7))
        for _, fields in entries:
            kind, entry = streams.decode(fields)
            if kind == streams.METRICS:
                for step, _, values in entry["points"]:
                    points[(entry["rank"], step)].update(values)
                    if "loss" in values:
                        losses.append((entry["rank"], step, values["loss"]))
        client.close()
        return Ran(dict(points), losses, done.stdout)
    finally:
        server.stop()


def test_manual_all_reduce_of_gradients_is_timed_and_counted(tmp_path: Path) -> None:
    steps = 8
    points = run_script(tmp_path, MANUAL_AVERAGING, steps).points
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
    points = run_script(tmp_path, FSDP2, steps).points
    assert {(rank, step) for rank in (0, 1) for step in range(1, steps + 1)} <= set(points)
    for (rank, step), metrics in points.items():
        # each unit: all-gathered (the whole unsharded buffer) for forward and again for backward
        # (reshard_after_forward), its gradients reduce-scattered (the whole unsharded input buffer)
        assert metrics["comm_bytes"] == 3 * sum(UNIT_BYTES), (rank, step, metrics)
        assert metrics["comm_time_s"] > 0 and metrics["busbw_GBps"] > 0, (rank, step, metrics)
        assert 0 < metrics["exposed_comm_s"] <= metrics["comm_time_s"], (rank, step, metrics)


def test_tensor_parallel_collectives_are_timed_and_counted(tmp_path: Path) -> None:
    steps = 5
    points = run_script(tmp_path, TENSOR_PARALLEL, steps).points
    assert {(rank, step) for rank in (0, 1) for step in range(1, steps + 1)} <= set(points)
    for (rank, step), metrics in points.items():
        # the row-wise Linear's partial outputs summed: one all-reduce of the (8, 8) output a step
        # (the column-wise one's input is the data: no gradient to all-reduce in backward)
        assert metrics["comm_bytes"] == metrics["comm_bytes_all_reduce"] == 8 * 8 * 4, (rank, step, metrics)
        assert 0 < metrics["exposed_comm_s"] == pytest.approx(metrics["comm_time_s"]), (rank, step, metrics)


def test_an_unmodified_scripts_loss_is_what_it_called_backward_on_unscaled_until_it_logs_its_own(
    tmp_path: Path,
) -> None:
    steps = 6
    ran = run_script(tmp_path, SCALED_ACCUMULATION, steps)
    printed = {}
    for line in ran.stdout.splitlines():
        if line.startswith("LOSS "):
            _, rank, step, value = line.split()
            printed[(int(rank), int(step))] = float(value)
    assert len(printed) == 2 * steps, ran.stdout[-2000:]
    by_step: dict[tuple[int, int], list[float]] = defaultdict(list)
    for rank, step, value in ran.losses:
        by_step[(rank, step)].append(value)
    for rank in (0, 1):
        for step in (1, 2, 3):  # ours: the mean of the two micro-batches, not ×1024 (the scale)
            assert by_step[(rank, step)] == [pytest.approx(printed[(rank, step)], rel=1e-6)], (rank, step, by_step)
        # the script's own loss from step 4: step 4 was captured by us first; later steps are its own
        assert by_step[(rank, 4)][-1] == -1.0
        for step in (5, 6):
            assert by_step[(rank, step)] == [-1.0], (rank, step, by_step)


CYCLE_AT_EXIT = """
import gc
import sys

gc.disable()  # as a busy script may never reach a collection before it ends


class Held:  # in a reference cycle, as DDP's module is with its reducer (and so its process group)
    def __init__(self):
        self.me = self

    def __del__(self):
        sys.stdout.write(f"collected while finalizing: {sys.is_finalizing()}\\n")
        sys.stdout.flush()


Held()
"""


@pytest.mark.parametrize("instrumented", [True, False])
def test_a_scripts_reference_cycles_die_before_interpreter_teardown(tmp_path: Path, instrumented: bool) -> None:
    """A DDP model dying in interpreter teardown can abort the rank after its last step (torch 2.13 with
    Gloo, ~1 exit in 5 here): the instrumentation collects the script's cycles at exit, while the
    interpreter is whole. Uninstrumented, the same cycle dies in teardown (the check can fail)."""
    script = tmp_path / "cycle.py"
    script.write_text(CYCLE_AT_EXIT)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")},
        "PYTHONPATH": os.pathsep.join((str(INJECT_DIR), str(PROJECT_ROOT))),
        "TORCHYARD_INSTRUMENT": "1" if instrumented else "0",
        "RANK": "0",
    }
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("collected while finalizing: False" in done.stdout) == instrumented, done.stdout
