"""DDP (plain all-reduce hook, timed) with ``ZeroRedundancyOptimizer``: each rank keeps the
optimizer state of its shard of the parameters, steps it, and broadcasts the updated shard. The
parameter sync (every parameter broadcast from the rank that owns it, all issued async and then
waited for) is timed as one interval the step waits for (exposed), with one broadcast's bytes per
parameter: one clock pair a step instead of a timed stand-in around each broadcast."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from workers.runtime.comm import BROADCAST, CommTimer, tensor_bytes
from workers.runtime.strategies.ddp import DdpStrategy
from workers.runtime.workloads import Workload


class ZeroStrategy(DdpStrategy):
    kind = "zero"

    def __init__(self, workload: Workload, device: torch.device, timer: CommTimer | None, lr: float) -> None:
        super().__init__(None, workload, device, timer, lr)

    def make_optimizer(self) -> torch.optim.Optimizer:
        # the workload's optimizer class and settings, sharded
        probe = self.workload.make_optimizer([nn.Parameter(torch.zeros(1))], self.lr0)
        optimizer = ZeroRedundancyOptimizer(self.ddp.parameters(), optimizer_class=type(probe), **probe.defaults)
        timer = self.timer
        if timer is not None:
            sync = optimizer._sync_params  # type: ignore[attr-defined]
            sizes = [tensor_bytes(p) for group in optimizer.param_groups for p in group["params"]]

            def timed_sync() -> None:
                timer.call(BROADCAST, 0, sync)  # the interval; its bytes are the broadcasts' own
                timer.add_bytes(BROADCAST, *sizes)

            optimizer._sync_params = timed_sync  # type: ignore[attr-defined]
        return optimizer

    def describe(self) -> str:
        return "zero"
