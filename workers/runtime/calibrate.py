"""A short nccl-tests-style calibration on the run's process group: all-reduce at a few sizes,
giving the achievable bus bandwidth that each step's ``busbw_efficiency`` is measured against."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from workers.runtime.comm import ALL_REDUCE, bus_factor

SIZES = (4 << 10, 256 << 10, 4 << 20, 32 << 20)  # bytes: 4 KB … 32 MB


def calibrate(
    device: torch.device, group: dist.ProcessGroup | None = None, sizes: tuple[int, ...] = SIZES, budget_s: float = 2.0
) -> dict[int, float]:
    """Median busbw (GB/s) of a float32 all-reduce per message size; {} on one rank.

    Every rank runs the same number of iterations (decided from rank 0's first timing, broadcast),
    so the collectives stay matched; the whole calibration takes about ``budget_s`` at most."""
    world = dist.get_world_size(group)
    if world < 2:
        return {}
    table: dict[int, float] = {}
    for size in sizes:
        buf = torch.ones(size // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buf, group=group)  # warm-up (connections, allocations)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # else the timed call's clock starts while the warm-up still runs
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first = time.perf_counter() - t0
        iters = torch.tensor([max(1, min(20, int(budget_s / len(sizes) / max(first, 1e-6))))], device=device)
        dist.broadcast(iters, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        times = [first]
        for _ in range(int(iters.item()) - 1):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dist.all_reduce(buf, group=group)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                dist.all_reduce(buf, group=group)
                times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        table[size] = size / seconds / 1e9 * bus_factor(ALL_REDUCE, world)
    return table
