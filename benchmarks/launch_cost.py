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
from testkit.torchrun import ROOT, spec, torchrun

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


def measured(run: Callable[[], object]) -> tuple[float, float]:
    """(CPU seconds of every process ``run`` started and waited for, wall seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    run()
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def python(code: str) -> Callable[[], tuple[float, float]]:
    return lambda: measured(lambda: subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True))


def launch(server: RedisServer, procs: int) -> Callable[[], tuple[float, float]]:
    """The built-in mlp, 1 step, under torch elastic as the suite's dist tests start it."""
    body = spec({"kind": "builtin", "name": "mlp", "params": {"hidden": 16, "samples": 256}}, steps=1, batch_size=32)
    body["resources"]["procs_per_node"] = procs

    def run() -> None:
        _run_id, done = torchrun(server, body)
        assert done.returncode == 0, done.stderr[-3000:]

    return lambda: measured(run)


def calibration() -> tuple[float, float]:
    """(CPU, wall) seconds of rank 0's calibration, measured inside it."""
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(CALIBRATE)
        script.flush()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script.name]
        out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    cpu, wall = map(float, out.split("calibrate")[1].split()[:2])
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp)).start()
        try:
            cases: list[tuple[str, Callable[[], tuple[float, float]]]] = [
                ("the interpreter (python -c pass)", python("pass")),
                ("import torch", python("import torch")),
                ("import torch, torch._dynamo", python("import torch, torch._dynamo")),
                ("import workers.runtime.train", python("import workers.runtime.train")),
                ("calibrate, 2 ranks (per rank, inside it)", calibration),
                ("torchrun, 1 rank, 1 step", launch(redis, 1)),
                ("torchrun, 2 ranks, 1 step", launch(redis, 2)),
                ("torchrun, 4 ranks, 1 step", launch(redis, 4)),
            ]
            rows = []
            for name, measure in cases:
                samples = [measure() for _ in range(args.repeat)]
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
