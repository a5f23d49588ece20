"""The overhead benchmark still measures what it claims: it patches torch's and our internals to
account the instrumentation, so a renamed hook or method would silently measure nothing. A short
run over every strategy must find instrumentation in every one (wrapped calls and time > 0), each
strategy's own entry points among the accounted parts (ZeRO's parameter sync, the FSDP comms, the
pipeline's P2P, ...), the hook switch measured where the bare build runs DDP's built-in all-reduce
(and only there), and every build's step times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.accounting import HOOK_SWITCH
from benchmarks.overhead import STRATEGIES

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
EVERY_STEP = {"CommTimer.begin_step", "CommTimer.batch_ready", "CommTimer.data_ready", "per-step figures + log"}
DDP_HOOK = {"DdpStrategy timed hook", "comm done callback", "backward-end callback"}
# where control enters each strategy's instrumentation (names as benchmarks/accounting.py gives them)
ENTRY_POINTS: dict[str, set[str]] = {
    "ddp/allreduce": DDP_HOOK | {HOOK_SWITCH},
    "ddp/fp16": DDP_HOOK,
    "ddp/powersgd": DDP_HOOK | {"TimedDist.all_reduce"},
    "zero": DDP_HOOK | {HOOK_SWITCH, "TimedSync.__call__"},
    "local_sgd": {"LocalSgdStrategy timed hook", "TimedDist.all_reduce"},
    "fsdp": {"TimedAllGather.__call__", "TimedReduceScatter.__call__"},
    "pipeline": {"timed _batch_p2p", "_TimedWork.wait"},
}
BUILTIN_BARE = {"ddp/allreduce", "zero"}  # plain all-reduce: bare = DDP's built-in path


@pytest.mark.timeout(120)
def test_overhead_benchmark_accounts_instrumentation_in_every_strategy(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "benchmarks.overhead", "--workload", "mlp", "--seconds", "1", "--reps", "1",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summaries = json.loads(out.read_text())
    assert set(summaries) == set(STRATEGIES) == set(ENTRY_POINTS), proc.stdout
    for name, s in summaries.items():
        context = f"{name}\n{proc.stdout}"
        assert s["instrumentation_us"] > 0 and s["calls"] > 0, f"no instrumentation accounted: {context}"
        accounted = {part for part, us in s["parts_us"].items() if us > 0}
        missing = (EVERY_STEP | ENTRY_POINTS[name]) - accounted
        assert not missing, f"not accounted: {missing}: {context}"
        builds = ["bare", "hook", "timed"] if name in BUILTIN_BARE else ["bare", "timed"]
        assert s["builds"] == builds, context
        assert (s["hook_switch_paired_us"] is not None) == (name in BUILTIN_BARE), context
        assert (s["hook_switch_us"] > 0) == (name in BUILTIN_BARE), context
        for build in builds:
            assert 0 < s["p50_ms"][build] <= s["p99_ms"][build], context
