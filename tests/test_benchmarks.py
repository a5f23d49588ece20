"""The overhead benchmark still measures what it claims: it patches torch's and our internals to
account the instrumentation, so a renamed hook or method would silently measure nothing. A short
run over every strategy must find instrumentation in every one (wrapped calls and time > 0)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.overhead import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_overhead_benchmark_accounts_instrumentation_in_every_strategy() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "benchmarks.overhead", "--workload", "mlp", "--seconds", "1", "--reps", "1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = re.findall(r"== (\S+):.*?instrumentation, measured\s+([\d.]+) µs/step.*?([\d.]+) wrapped calls/step",
                          proc.stdout, re.S)  # fmt: skip
    assert {name for name, _, _ in measured} == set(STRATEGIES), proc.stdout
    for name, us, calls in measured:
        assert float(us) > 0 and float(calls) > 0, f"{name}: no instrumentation accounted\n{proc.stdout}"
