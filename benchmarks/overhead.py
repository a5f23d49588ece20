"""Instrumentation overhead: the same training loop bare (torch's hooks and comms, no CommTimer)
and instrumented (timed hooks/comms + per-step figures), interleaved rep by rep, per strategy.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.overhead [--steps 30 --reps 7]

Rank 0 prints, per strategy, the median step time of each and the overhead in percent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from torchyard.spec import RunSpec
from workers.runtime import strategies
from workers.runtime.comm import CommTimer, memory_figures
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


def spec_for(strategy: dict[str, object], world: int, device: str) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": "overhead",
            "workload": {"name": "mlp", "params": {"hidden": 256, "layers": 3, "samples": 8192}},
            "strategy": strategy,
            "resources": {"procs_per_node": world, "device": device},
            "training": {"steps": 1000, "batch_size": 128, "lr": 0.01, "seed": 0},
        }
    )


def loop(spec: RunSpec, instrumented: bool, steps: int, device: torch.device) -> float:
    """Seconds per step of ``steps`` steps (after 3 warm-up steps) with a freshly built strategy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(0)
    workload = build(spec)
    timer = CommTimer(world, device) if instrumented else None
    strategy = strategies.build(spec, workload, device, timer)
    per_rank = spec.training.batch_size // world if strategy.data_parallel else spec.training.batch_size
    shard, shards = (rank, world) if strategy.data_parallel else (0, 1)
    data = batches(workload, per_rank, shard, shards, 0)
    sink: list[dict[str, float]] = []
    elapsed = 0.0
    for step in range(1, steps + 4):
        batch = tuple(x.to(device) for x in next(data))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        if timer is not None:
            timer.begin_step(step)
        strategy.train_step(batch)
        if timer is not None:  # what train.py does per step: figures + memory
            for _, fig in timer.end_step():
                fig.update(memory_figures(device))
                sink.append(fig)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step > 3:
            elapsed += time.perf_counter() - t0
    strategy.close()
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for name in args.only:
        spec = spec_for(STRATEGIES[name], world, args.device)
        bare: list[float] = []
        timed: list[float] = []
        for rep in range(args.reps):
            order = (False, True) if rep % 2 == 0 else (True, False)  # interleaved, alternating first
            for instrumented in order:
                (timed if instrumented else bare).append(loop(spec, instrumented, args.steps, device))
        b, t = statistics.median(bare), statistics.median(timed)
        rows.append((name, b * 1e3, t * 1e3, (t - b) / b * 100))
    if rank == 0:
        print(f"{'strategy':<16} {'bare ms/step':>13} {'timed ms/step':>14} {'overhead %':>11}")
        for name, b, t, pct in rows:
            print(f"{name:<16} {b:13.2f} {t:14.2f} {pct:11.2f}")
        print(
            f"(median of {args.reps} interleaved reps of {args.steps} steps; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
