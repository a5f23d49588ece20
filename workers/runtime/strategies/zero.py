"""DDP (plain all-reduce hook, timed) with ``ZeroRedundancyOptimizer``: each rank keeps the
optimizer state of its shard of the parameters, steps it, and broadcasts the updated shard. The
broadcasts are timed through a stand-in for the optimizer module's ``dist``; the step waits for
them (exposed)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.optim import zero_redundancy_optimizer as zero_module

from workers.runtime.comm import CommTimer, patch_dist
from workers.runtime.strategies.ddp import DdpStrategy
from workers.runtime.workloads import Workload


class ZeroStrategy(DdpStrategy):
    kind = "zero"

    def __init__(self, workload: Workload, device: torch.device, timer: CommTimer | None, lr: float) -> None:
        super().__init__(None, workload, device, timer, lr)

    def make_optimizer(self) -> torch.optim.Optimizer:
        # the workload's optimizer class and settings, sharded
        probe = self.workload.make_optimizer([nn.Parameter(torch.zeros(1))], self.lr0)
        if self.timer is not None:
            self._undo.append(patch_dist(zero_module, self.timer))
        return ZeroRedundancyOptimizer(self.ddp.parameters(), optimizer_class=type(probe), **probe.defaults)

    def describe(self) -> str:
        return "zero"
