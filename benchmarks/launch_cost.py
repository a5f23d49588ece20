"""What starting things costs, in CPU seconds: the floor under the test suite's run time (issue 26).
Every run the suite makes, bare or through the platform, starts torch elastic's agent and one process
per rank, and every rank imports torch and, at its first DDP wrap or optimizer step, torch._dynamo
(torch's own lazy imports: DDP's ``__init__`` asks ``torch._dynamo.utils`` for its mode, and
``torch.optim`` reaches it too); a multi-rank run then calibrates its all-reduce (about 2 s of budget).
The suite's time is mostly these, so a test that starts fewer ranks is a faster test.

    python -m benchmarks.launch_cost [--repeat 3]

Each figure is the median over ``--repeat`` fresh processes of their user + system CPU
(``RUSAGE_CHILDREN`` around each), and the wall time beside it; the rows after the imports launch
the built-in mlp (hidden 16, 1 step) under ``torch.distributed.run`` as the suite does, against a
private redis-server. Ratios are against the bare interpreter measured in the same run."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cli.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
CALIBRATE = """
import time, torch, torch.distributed as dist
from workers.runtime.calibrate import calibrate
dist.init_process_group("gloo")
start, wall = time.process_time(), time.perf_counter()
calibrate(torch.device("cpu"))
if dist.get_rank() == 0:
    print("calibrate", time.process_time() - start, time.perf_counter() - wall)
dist.destroy_process_group()
"""


def cpu_of(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(CPU seconds of the command and every process it waited for, wall seconds, its output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, done.stdout


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def launch(redis_url: str, procs: int) -> Callable[[], tuple[float, float, str]]:
    spec = {
        "name": "launch-cost",
        "workload": {"kind": "builtin", "name": "mlp", "params": {"hidden": 16, "samples": 256}},
        "strategy": {"kind": "ddp"},
        "resources": {"procs_per_node": procs, "device": "cpu"},
        "training": {"steps": 1, "batch_size": 32, "lr": 0.01, "seed": 0},
    }
    env = {
        **os.environ,
        "TORCHYARD_SPEC": json.dumps(spec),
        "TORCHYARD_RANK_REDIS_URL": redis_url,
        "TORCHYARD_RUN_ID": "1",
        "TORCHYARD_ATTEMPT": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(procs), "-m", "workers.runtime.train"]  # fmt: skip
    return lambda: cpu_of(command, env)


def calibration() -> tuple[float, float, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(CALIBRATE)
        script.flush()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script.name]
        _cpu, _wall, out = cpu_of(command, env)
    cpu, wall = map(float, out.split("calibrate")[1].split()[:2])
    return cpu, wall, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp)).start()
        try:
            cases: list[tuple[str, Callable[[], tuple[float, float, str]]]] = [
                ("the interpreter (python -c pass)", lambda: cpu_of(python("pass"))),
                ("import torch", lambda: cpu_of(python("import torch"))),
                ("import torch, torch._dynamo", lambda: cpu_of(python("import torch, torch._dynamo"))),
                ("import workers.runtime.train", lambda: cpu_of(python("import workers.runtime.train"))),
                ("calibrate, 2 ranks (per rank, inside it)", calibration),
                ("torchrun, 1 rank, 1 step", launch(redis.url, 1)),
                ("torchrun, 2 ranks, 1 step", launch(redis.url, 2)),
                ("torchrun, 4 ranks, 1 step", launch(redis.url, 4)),
            ]
            rows = []
            for name, measure in cases:
                samples = [measure()[:2] for _ in range(args.repeat)]
                rows.append((name, statistics.median(c for c, _ in samples), statistics.median(w for _, w in samples)))
        finally:
            redis.stop()
    bare = rows[0][1]
    print(f"{'what starts':44} {'CPU s':>7} {'wall s':>7} {'× bare':>7}")
    for name, cpu, wall in rows:
        print(f"{name:44} {cpu:7.2f} {wall:7.2f} {cpu / bare:7.1f}")
    one, two, four = (cpu for _name, cpu, _wall in rows[-3:])
    print(f"a rank beyond the first: {(two - one):.2f} s of CPU (2 vs 1), {(four - two) / 2:.2f} s (4 vs 2)")


if __name__ == "__main__":
    main()
