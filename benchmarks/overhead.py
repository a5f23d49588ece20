"""Instrumentation overhead per strategy: the same training loop bare (torch's hooks and comms, no
CommTimer, no SDK) and with every always-on instrumentation (timed hooks/comms, per-step figures,
memory figures and the SDK into a real Redis, through the same ``StepLog`` as
``workers/runtime/train.py``), two ways:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.overhead [--quick]
        [--workload charlm|mlp] [--hidden 256]

1. **Paired, interleaved.** Both variants are built side by side (same weights, same data) and run
   in short blocks of ``--steps`` steps in ABBA order (bare, timed, timed, bare: a linear drift
   cancels within each quad), each block after a barrier. Per quad the paired ratio
   (timed blocks / bare blocks); reported: the median ratio with its distribution-free 95 % CI
   (order statistics) and the mean paired difference with a t-style 95 % CI. On a busy machine
   this still jitters by about a percent: it bounds the overhead, it does not pin it.
2. **Measured directly (the number held to ≤ 1 %).** A third, instrumented build runs with every
   piece of instrumentation code wrapped in accounting: CommTimer's methods and future callbacks,
   the strategies' timed hooks / all-gathers / reduce-scatters / ``dist`` stand-ins / P2P wrapper,
   the loop's per-step figures (``StepLog``: figures, memory, SDK log), on whatever thread runs
   them (torch's own hooks and collectives nested inside are excluded), plus the CPU time of the
   SDK's writer thread (encode + XADD). Exclusive time, summed over threads, per step, as a
   fraction of the bare step. ``--clock cpu`` (default) counts each thread's CPU time: the work
   the instrumentation adds; ``--clock wall`` counts wall time, which on a machine whose cores the
   ranks oversubscribe (2 ranks + their Gloo threads on 2 cores here) also charges the
   instrumentation for being preempted, often by the collective it just launched: an upper bound.
   The accounting's own cost per wrapped call is measured in place and shown.

Rank 0 prints one table per strategy, then a summary. ``--quick``: about a minute in all.
"""

from __future__ import annotations

import argparse
import contextlib
import math
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
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.algorithms.model_averaging import utils as averaging_utils
from torch.distributed.pipelining import schedules as schedules_module

from benchmarks.accounting import CLOCKS, Accounting, accounted_instrumentation
from torchyard import sdk
from torchyard.spec import RunSpec
from workers.runtime import strategies
from workers.runtime.comm import CommTimer
from workers.runtime.steplog import StepLog
from workers.runtime.strategies.base import Strategy
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
    """One build of the strategy: bare, or instrumented as train.py instruments it."""

    spec: RunSpec
    device: torch.device
    instrumented: bool
    strategy: Strategy = field(init=False)
    timer: CommTimer | None = field(init=False)
    patches: dict[tuple[int, str], Any] = field(default_factory=dict)
    step_no: int = 0
    step_log: StepLog | None = None

    def __post_init__(self) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        seed_everything(0)
        workload = build(self.spec)
        self.timer = CommTimer(world, self.device) if self.instrumented else None
        self.step_log = StepLog(self.timer, sdk.log_floats) if self.timer is not None else None
        self.strategy = strategies.build(self.spec, workload, self.device, self.timer)
        self.patches = {(i, name): getattr(owner, name) for i, (owner, name) in enumerate(PATCH_POINTS)}
        self.per_rank = (
            self.spec.training.batch_size // world if self.strategy.data_parallel else self.spec.training.batch_size
        )
        shard, shards = (rank, world) if self.strategy.data_parallel else (0, 1)
        self.data = batches(workload, self.per_rank, shard, shards, 0)
        self.after: Callable[[torch.Tensor | None, float, float], None] = self.bookkeeping

    def use(self) -> None:
        """Put this build's module globals (timed stand-ins or torch's own) in place."""
        for (i, name), value in self.patches.items():
            setattr(PATCH_POINTS[i][0], name, value)

    def step(self) -> None:
        self.step_no += 1
        if self.timer is not None:
            self.timer.begin_step(self.step_no)
        t0 = time.perf_counter()
        batch = tuple(x.to(self.device, non_blocking=True) for x in next(self.data))
        t1 = time.perf_counter()
        loss = self.strategy.train_step(batch)
        if self.timer is not None:
            self.after(loss, t0, t1)

    def bookkeeping(self, loss: torch.Tensor | None, t0: float, t1: float) -> None:
        """What train.py does after each (logged: log_every=1) step."""
        assert self.step_log is not None
        scalars = {"lr": self.strategy.lr, "data_time_s": t1 - t0, **self.strategy.extra_metrics()}
        self.step_log.hold(self.step_no, scalars, per_step={"samples_per_s": float(self.per_rank)}, loss=loss)
        self.step_log.end_step()

    def block(self, steps: int) -> float:
        """Seconds for ``steps`` steps, started together on every rank."""
        self.use()
        dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.step_log is not None:
            self.step_log.flush()
        self.strategy.close()


def median_ci(values: list[float]) -> tuple[float, float, float]:
    """Median and its distribution-free 95 % CI (order statistics n/2 ± 0.98·√n)."""
    xs = sorted(values)
    n = len(xs)
    half = 0.98 * math.sqrt(n)
    lo, hi = max(0, math.floor(n / 2 - half) - 1), min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(xs), xs[lo], xs[hi]


def mean_ci(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, 1.96 * sd / math.sqrt(len(values))


def agree(value: float) -> float:
    """Rank 0's value on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return float(box[0])


def measure(
    spec: RunSpec, device: torch.device, block: int, seconds: float, min_quads: int, clock: str = "cpu"
) -> dict[str, Any]:
    bare, timed = Variant(spec, device, False), Variant(spec, device, True)
    for _ in range(3):  # warm-up: DDP rebuilds its buckets, PowerSGD/local SGD leave their warm-up
        bare.block(block)
        timed.block(block)
    probe = (bare.block(block) + timed.block(block)) / 2
    quads = int(agree(max(min_quads, min(5000, seconds * 0.8 / (4 * probe)))))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(quads):
        for variant in (bare, timed, timed, bare):  # ABBA
            times[variant.instrumented].append(variant.block(block) / block)
    bare.close()
    timed.close()
    bare.use()
    sdk.flush()
    # the direct measurement: an instrumented build with its instrumentation accounted
    acct = Accounting(CLOCKS[clock])
    with accounted_instrumentation(acct):
        probe_timed = Variant(spec, device, True)
        probe_timed.after = acct.counted(probe_timed.bookkeeping, "per-step figures + log")
        key = (PATCH_POINTS.index((schedules_module, "_batch_p2p")), "_batch_p2p")
        if probe_timed.patches[key] is not schedules_module._batch_p2p:  # the pipeline's timed wrapper
            probe_timed.patches[key] = acct.counted(probe_timed.patches[key], "timed _batch_p2p")
        for _ in range(3):
            probe_timed.block(block)
        sdk.flush()
        acct.reset()
        calibration, noop = Accounting(CLOCKS[clock]), lambda: None
        self_charge = calibration.counted(noop, "noop")
        blocks = int(agree(max(2, min(1000, seconds * 0.2 / probe))))
        per_step: list[float] = []  # instrumentation ns of each step, all threads but the SDK writer's
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
    steps = blocks * block
    mine = {
        "bare": times[False],
        "timed": times[True],
        "direct": {k: v / steps for k, v in totals.items()},
        "median_ns": statistics.median(per_step),
        "charge_ns": calibration.ns() / (blocks * block),
        "by_name": {k: v / steps for k, v in by_name.items()},
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {"quads": quads, "block": block, "ranks": ranks}


def report(name: str, result: dict[str, Any]) -> tuple[str, ...]:
    ranks = result["ranks"]
    n_blocks = len(ranks[0]["bare"])
    bare = [statistics.fmean(r["bare"][i] for r in ranks) for i in range(n_blocks)]  # per block, mean over ranks
    timed = [statistics.fmean(r["timed"][i] for r in ranks) for i in range(n_blocks)]
    ratios, diffs = [], []
    for q in range(result["quads"]):  # ABBA: blocks 2q, 2q+1 of each variant
        b = bare[2 * q] + bare[2 * q + 1]
        t = timed[2 * q] + timed[2 * q + 1]
        ratios.append(t / b)
        diffs.append((t - b) / 2)
    bare_ms, timed_ms = statistics.median(bare) * 1e3, statistics.median(timed) * 1e3
    ratio, lo, hi = median_ci(ratios)
    diff, half = mean_ci(diffs)
    worst = max(ranks, key=lambda r: r["median_ns"] + r["direct"]["writer"])
    direct = worst["direct"]
    us = (worst["median_ns"] + direct["writer"]) / 1e3
    mean_us = (direct["main"] + direct["other"] + direct["writer"]) / 1e3
    pct = us / (bare_ms * 1e3) * 100
    net_off = direct["calls"] * worst["charge_ns"] / 1e3
    top = sorted(worst["by_name"].items(), key=lambda kv: -kv[1])[:4]
    lines = [
        f"== {name}: {result['quads']} ABBA quads of {result['block']}-step blocks per variant",
        f"  bare step                      {bare_ms:9.3f} ms   (median block)",
        f"  instrumented step              {timed_ms:9.3f} ms",
        f"  paired ratio timed/bare        {ratio:9.4f}      95% CI [{lo:.4f}, {hi:.4f}]  (median over quads)",
        f"  paired difference              {diff / (bare_ms / 1e3) * 100:+9.2f} %    ± {half / (bare_ms / 1e3) * 100:.2f} % (mean, 95% CI)",
        f"  instrumentation, measured      {us:9.1f} µs/step = {pct:.3f} % of the bare step "
        f"(worst rank: median step {worst['median_ns'] / 1e3:.1f} + SDK writer CPU {direct['writer'] / 1e3:.1f}; "
        f"{direct['calls']:.0f} wrapped calls/step)",
        f"  less the accounting's own cost {max(0.0, us - net_off):9.1f} µs/step = {max(0.0, us - net_off) / (bare_ms * 1e3) * 100:.3f} % "
        f"(≈ {worst['charge_ns'] / 1e3:.2f} µs charged per wrapped call, measured in place)",
        f"  mean over steps                {mean_us:9.1f} µs/step = {mean_us / (bare_ms * 1e3) * 100:.3f} % "
        f"(training thread {direct['main'] / 1e3:.1f}, other threads {direct['other'] / 1e3:.1f})",
        "  largest parts (µs/step)        " + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in top),
    ]
    print("\n".join(lines), flush=True)
    return (
        name,
        f"{bare_ms:.3f}",
        f"{timed_ms:.3f}",
        f"{ratio:.4f} [{lo:.4f}, {hi:.4f}]",
        f"{us:.1f}",
        f"{pct:.3f}",
    )


@contextlib.contextmanager
def sdk_target() -> Iterator[None]:
    """Point the SDK at a real Redis (a private redis-server unless TORCHYARD_REDIS_URL is set)."""
    server = None
    url = os.environ.get("TORCHYARD_REDIS_URL", "")
    if not url and dist.get_rank() == 0:
        from torchyard.procs import RedisServer

        server = RedisServer(Path(tempfile.mkdtemp(prefix="overhead-redis-"))).start()
        url = server.url
    box = [url]
    dist.broadcast_object_list(box, src=0)
    os.environ["TORCHYARD_REDIS_URL"] = str(box[0])
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
    parser.add_argument("--reps", type=int, default=5, help="at least this many ABBA quads")
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
    rows = []
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
                rows.append(report(name, result))
    if rank == 0:
        header = ("strategy", "bare ms", "instr ms", "ratio median [95% CI]", "instr µs/step", "% of step")
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        print()
        for row in [header, *rows]:
            print(
                "  ".join(
                    str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
                )
            )
        print(
            f"({world} ranks, {args.device}, {shown}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
            f"{time.perf_counter() - started:.0f} s; '% of step' = directly measured instrumentation time / bare step: "
            "the figure held to ≤ 1 %)",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
