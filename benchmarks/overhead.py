"""Instrumentation overhead per strategy: the same training loop bare (no torchyard at all: no
CommTimer, no StepLog, no SDK; plain all-reduce through DDP's built-in C++ path, as an unmodified
script runs it) and with every always-on instrumentation (timed hooks/comms, per-step figures,
memory figures and the SDK into a real Redis, through the same ``StepLog`` as
``workers/runtime/train.py``), two ways:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.overhead [--quick]
        [--workload charlm|mlp] [--hidden 256] [--json out.json]

1. **Paired, interleaved.** The builds live side by side (same weights, same data) and run in
   short blocks of ``--steps`` steps, each block after a barrier, round after round in the order
   bare, hook, timed, timed, hook, bare (a linear drift cancels between any two builds). ``hook``
   (plain all-reduce only: ddp/allreduce, zero) is the bare build with torch's Python
   ``allreduce_hook`` registered, untimed: instrumenting DDP means replacing the built-in
   all-reduce by a Python hook, and this is that switch's own cost. Every step's wall time is
   recorded: p50 and p99 over all steps of all ranks per build. Per round the paired ratio (timed
   blocks / bare blocks) and differences; reported: the median ratio with its distribution-free
   95 % CI (order statistics), the mean paired differences with a 95 % CI. On a busy machine these
   jitter by about a percent: they bound the overhead, they do not pin it.
2. **Measured directly.** One more instrumented build runs with every piece of instrumentation
   code wrapped in accounting (``benchmarks/accounting.py``): CommTimer's methods and future
   callbacks, the strategies' timed hooks / all-gathers / reduce-scatters / ``dist`` stand-ins /
   P2P wrapper / ZeRO parameter sync, the loop's per-step figures (``StepLog``: figures, memory,
   SDK log), on whatever thread runs them (torch's own hooks and collectives nested inside are
   excluded), plus the CPU time of the SDK's writer thread (encode + XADD). Where the bare build
   runs the built-in all-reduce, torch's Python ``allreduce_hook`` inside the timed hook is counted
   too (the hook switch, directly), less the work the built-in path does as well (the division and
   the collective's C++ launch). Exclusive time, summed over threads, per step: the worst rank's
   mean over steps (periodic work counts as often as it comes). ``--clock cpu`` (default) counts
   each thread's CPU time: the work the instrumentation adds; ``--clock wall`` counts wall time,
   which on a machine whose cores the ranks oversubscribe (2 ranks + their Gloo threads on 2 cores
   here) also charges the instrumentation for being preempted, often by the collective it just
   launched: an upper bound. The accounting's own cost per wrapped call is measured in place.

The overhead held to ≤ 1 % of the bare p50 step is the direct measurement (instrumentation + hook
switch); the wall-time figures of 1. bound it from outside, with GIL stalls and periodic slow steps
in p99. Rank 0 prints each strategy's figures (``benchmarks/overhead_report.py``), then a table.
``--quick``: a minute or two in all.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.model_averaging import utils as averaging_utils
from torch.distributed.pipelining import schedules as schedules_module

from benchmarks.accounting import CLOCKS, Accounting, accounted_instrumentation
from benchmarks.overhead_report import BARE, HOOK, TIMED, row, show, summarize, table
from torchyard import sdk
from torchyard.spec import RunSpec
from workers.runtime import strategies
from workers.runtime.comm import CommTimer
from workers.runtime.steplog import StepLog
from workers.runtime.strategies.base import Strategy
from workers.runtime.strategies.ddp import DdpStrategy
from workers.runtime.train import batches, seed_everything
from workers.runtime.workloads import build

STRATEGIES: dict[str, dict[str, object]] = {
    "ddp/allreduce": {"kind": "ddp"},
    "ddp/fp16": {"kind": "ddp", "comm_hook": "fp16"},
    "ddp/powersgd": {"kind": "ddp", "comm_hook": "powersgd", "powersgd_warmup": 2},
    "zero": {"kind": "zero"},
    "local_sgd": {"kind": "local_sgd", "period": 4, "warmup_steps": 2},
    "fsdp": {"kind": "fsdp"},
    "pipeline": {"kind": "pipeline", "microbatches": 4},
}
# module globals the instrumented strategies replace (timed stand-ins); toggled per block, since the
# bare and the timed build live side by side
PATCH_POINTS: list[tuple[Any, str]] = [
    (powerSGD_hook, "dist"),
    (averaging_utils, "dist"),
    (schedules_module, "_batch_p2p"),
]


def workload_for(name: str, hidden: int) -> dict[str, object]:
    if name == "charlm":  # the strategies benchmark's model
        from benchmarks.strategies import CHARLM

        return dict(CHARLM)
    return {"name": "mlp", "params": {"hidden": hidden, "layers": 3, "samples": 8192}}


def spec_for(strategy: dict[str, object], world: int, device: str, workload: dict[str, object]) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": "overhead",
            "workload": workload,
            "strategy": strategy,
            "resources": {"procs_per_node": world, "device": device},
            "training": {"steps": 1000, "batch_size": 128 if workload["name"] == "mlp" else 32, "lr": 0.01, "seed": 0},
        }
    )


# ---- the loop -----------------------------------------------------------------------------------


@dataclass
class Variant:
    """One build of the strategy: ``bare`` (no torchyard: no CommTimer, no StepLog, no SDK; plain
    all-reduce through DDP's built-in C++ path), ``hook`` (bare with torch's Python
    ``allreduce_hook`` registered, untimed: the hook switch the instrumentation makes), or
    ``timed`` (instrumented as train.py instruments it)."""

    spec: RunSpec
    device: torch.device
    kind: str
    strategy: Strategy = field(init=False)
    timer: CommTimer | None = field(init=False)
    patches: dict[tuple[int, str], Any] = field(default_factory=dict)
    step_no: int = 0
    step_log: StepLog | None = None

    def __post_init__(self) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        seed_everything(0)
        workload = build(self.spec)
        self.timer = CommTimer(world, self.device) if self.kind == TIMED else None
        self.step_log = StepLog(self.timer, sdk.log_floats) if self.timer is not None else None
        self.strategy = strategies.build(self.spec, workload, self.device, self.timer)
        if self.kind == HOOK:  # the switch alone: torch's Python hook where bare runs the built-in path
            strategy = self.strategy
            assert isinstance(strategy, DdpStrategy) and strategy.builtin_allreduce, f"{strategy.describe()} has a hook"
            strategy.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        self.patches = {(i, name): getattr(owner, name) for i, (owner, name) in enumerate(PATCH_POINTS)}
        shard, shards = self.strategy.data_shard(rank, world)
        self.per_rank = self.spec.training.batch_size // shards
        self.data = batches(workload, self.per_rank, shard, shards, 0)
        self.after: Callable[[torch.Tensor | None], None] = self.bookkeeping

    @property
    def builtin_allreduce(self) -> bool:
        """The build all-reduces through DDP's built-in path (no Python hook)."""
        return isinstance(self.strategy, DdpStrategy) and self.strategy.builtin_allreduce

    def use(self) -> None:
        """Put this build's module globals (timed stand-ins or torch's own) in place."""
        for (i, name), value in self.patches.items():
            setattr(PATCH_POINTS[i][0], name, value)

    def step(self) -> None:
        self.step_no += 1
        if self.timer is not None:
            self.timer.begin_step(self.step_no)
        host = next(self.data)
        if self.timer is not None:
            self.timer.batch_ready()
        batch = tuple(x.to(self.device, non_blocking=True) for x in host)
        if self.timer is not None:
            self.timer.data_ready()
        loss = self.strategy.train_step(batch)
        if self.timer is not None:
            self.after(loss)

    def bookkeeping(self, loss: torch.Tensor | None) -> None:
        """What train.py does after each (logged: log_every=1) step."""
        assert self.step_log is not None
        scalars = {"lr": self.strategy.lr, **self.strategy.extra_metrics()}  # data_time_s: the timer's
        self.step_log.hold(self.step_no, scalars, per_step={"samples_per_s": float(self.per_rank)}, loss=loss)
        self.step_log.end_step()

    def block(self, steps: int) -> list[float]:
        """Each step's wall seconds, the block started together on every rank. A mark between
        steps: the clock on CPU; on CUDA an event on the current stream (the step as the device
        runs it, with no sync inside the block)."""
        self.use()
        dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            events[0].record()
            for event in events[1:]:
                self.step()
                event.record()
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]
        marks = [time.perf_counter()]
        for _ in range(steps):
            self.step()
            marks.append(time.perf_counter())
        return [b - a for a, b in itertools.pairwise(marks)]

    def close(self) -> None:
        if self.step_log is not None:
            self.step_log.flush()
        self.strategy.close()


def agree(value: float) -> float:
    """Rank 0's value on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return float(box[0])


def measure(
    spec: RunSpec, device: torch.device, block: int, seconds: float, min_rounds: int, clock: str = "cpu"
) -> dict[str, Any]:
    bare = Variant(spec, device, BARE)
    variants = [bare, *([Variant(spec, device, HOOK)] if bare.builtin_allreduce else []), Variant(spec, device, TIMED)]
    for _ in range(3):  # warm-up: DDP rebuilds its buckets, PowerSGD/local SGD leave their warm-up
        for variant in variants:
            variant.block(block)
    probe = statistics.fmean(sum(v.block(block)) for v in variants)  # seconds per block
    order = variants + variants[::-1]  # bare, (hook,) timed, timed, (hook,) bare: any pair is ABBA
    rounds = int(agree(max(min_rounds, min(5000, seconds * 0.8 / (len(order) * probe)))))
    steps: dict[str, list[list[float]]] = {v.kind: [] for v in variants}
    for _ in range(rounds):
        for variant in order:
            steps[variant.kind].append(variant.block(block))
    for variant in variants:
        variant.close()
    bare.use()
    sdk.flush()
    # the direct measurement: an instrumented build with its instrumentation accounted
    acct = Accounting(CLOCKS[clock])
    with accounted_instrumentation(acct):
        torch_p2p = schedules_module._batch_p2p  # torch's, excluded
        probe_timed = Variant(spec, device, TIMED)
        probe_timed.after = acct.counted(probe_timed.bookkeeping, "per-step figures + log")
        key = (PATCH_POINTS.index((schedules_module, "_batch_p2p")), "_batch_p2p")
        if probe_timed.patches[key] is not torch_p2p:  # the pipeline put its timed wrapper there
            probe_timed.patches[key] = acct.counted(probe_timed.patches[key], "timed _batch_p2p")
        for _ in range(3):
            probe_timed.block(block)
        sdk.flush()
        acct.reset()
        calibration, noop = Accounting(CLOCKS[clock]), lambda: None
        self_charge = calibration.counted(noop, "noop")
        blocks = int(agree(max(2, min(1000, seconds * 0.2 / probe))))
        per_step: list[int] = []  # instrumentation ns of each step, all threads but the SDK writer's
        for _ in range(blocks):
            probe_timed.use()
            dist.barrier()
            for _ in range(block):
                before = acct.ns()
                probe_timed.step()
                per_step.append(acct.ns() - before)
                self_charge()  # in the same state as the accounted code: what one wrapper charges
        sdk.flush()
        probe_timed.close()
        totals = acct.totals()
        by_name = acct.by_name()
    n = blocks * block
    mine = {
        "steps": steps,
        "direct": {k: v / n for k, v in totals.items()},
        "per_step_ns": per_step,
        "charge_ns": calibration.ns() / n,
        "by_name": {k: v / n for k, v in by_name.items()},
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {"rounds": rounds, "block": block, "ranks": ranks}


@contextlib.contextmanager
def sdk_target() -> Iterator[None]:
    """Point the SDK at a real Redis (a private redis-server unless TORCHYARD_RANK_REDIS_URL is set)."""
    server = None
    url = os.environ.get("TORCHYARD_RANK_REDIS_URL", "")
    if not url and dist.get_rank() == 0:
        from cli.redis_server import RedisServer

        server = RedisServer(Path(tempfile.mkdtemp(prefix="overhead-redis-"))).start()
        url = server.url
    box = [url]
    dist.broadcast_object_list(box, src=0)
    os.environ["TORCHYARD_RANK_REDIS_URL"] = str(box[0])
    os.environ.setdefault("TORCHYARD_RUN_ID", "999999")
    try:
        yield
    finally:
        sdk.flush()
        dist.barrier()
        if server is not None:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="about a minute in all (default: ~5 min)")
    parser.add_argument("--seconds", type=float, help="measuring time per strategy (default 28; --quick 4.5)")
    parser.add_argument(
        "--steps", type=int, help="steps per block, a multiple of local SGD's period (default: charlm 4, mlp 8)"
    )
    parser.add_argument("--reps", type=int, default=5, help="at least this many rounds")
    parser.add_argument("--json", type=Path, help="also write every strategy's summary here (rank 0)")
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="cpu",
        help="what the direct measurement counts: each thread's CPU time in instrumentation code, "
        "or wall time (adds preemption while in it: an upper bound on an oversubscribed machine)",
    )
    parser.add_argument(
        "--workload",
        choices=["mlp", "charlm"],
        default="charlm",
        help="charlm (the strategies benchmark's transformer: 57-92 ms steps on 2 CPU ranks here) or mlp "
        "(tiny steps, --hidden: the hardest case for a fixed cost per step)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=256,
        help="the mlp's width: the instrumentation's cost per step is about fixed, "
        "so its share falls as steps grow (256: ~3 ms steps on 2 CPU ranks; 1024: ~25 ms)",
    )
    args = parser.parse_args()
    seconds = args.seconds or (4.5 if args.quick else 28.0)
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo", device_id=device if args.device == "cuda" else None
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    started = time.perf_counter()
    workload = workload_for(args.workload, args.hidden)
    shown = f"mlp hidden={args.hidden}" if args.workload == "mlp" else f"charlm {workload['params']}"
    summaries: dict[str, dict[str, Any]] = {}
    with sdk_target():
        for name in args.only:
            result = measure(
                spec_for(STRATEGIES[name], world, args.device, workload),
                device,
                args.steps or (4 if args.workload == "charlm" else 8),
                seconds,
                args.reps,
                args.clock,
            )
            if rank == 0:
                summaries[name] = summarize(result)
                show(name, summaries[name])
    if rank == 0:
        table(
            [row(name, s) for name, s in summaries.items()],
            f"({world} ranks, {args.device}, {shown}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
            f"{time.perf_counter() - started:.0f} s; step times: ms of wall time, every step of every rank; "
            "bare = no torchyard, plain all-reduce through DDP's built-in path; 'hook Δ % paired' = torch's Python "
            "allreduce_hook untimed vs that path, mean ± 95% CI; 'hook µs', 'instr µs' = the hook switch and "
            "torchyard's code measured directly (CPU µs/step); 'overhead %' = their sum / bare p50: held to ≤ 1 %)",
        )
        if args.json:
            args.json.write_text(json.dumps(summaries, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
