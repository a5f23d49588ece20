"""DDP (plain all-reduce hook, timed) with ``ZeroRedundancyOptimizer``: each rank keeps the
optimizer state of its shard of the parameters, steps it, and broadcasts the updated shard. The
parameter sync (every parameter broadcast from the rank that owns it, all issued async and then
waited for) is timed as one interval the step waits for (exposed), with one broadcast's bytes per
parameter: one clock pair a step instead of a timed stand-in around each broadcast."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from workers.runtime.comm import BROADCAST, CommTimer, tensor_bytes
from workers.runtime.strategies.base import state_tensors
from workers.runtime.strategies.ddp import DdpStrategy
from workers.runtime.workloads import Workload


class TimedSync:
    """Stands in for the optimizer's ``_sync_params``: the whole sync as one interval, with each
    parameter's broadcast bytes (the broadcasts run inside it)."""

    def __init__(self, timer: CommTimer, optimizer: ZeroRedundancyOptimizer) -> None:
        self.timer, self.sync = timer, optimizer._sync_params  # type: ignore[attr-defined]
        self.sizes = [tensor_bytes(p) for group in optimizer.param_groups for p in group["params"]]

    def __call__(self) -> None:
        self.timer.call(BROADCAST, 0, self.sync)  # the interval; its bytes are the broadcasts' own
        self.timer.add_bytes(BROADCAST, *self.sizes)


class ZeroStrategy(DdpStrategy):
    kind = "zero"

    def __init__(self, workload: Workload, device: torch.device, timer: CommTimer | None, lr: float) -> None:
        super().__init__(None, workload, device, timer, lr)

    def make_optimizer(self) -> torch.optim.Optimizer:
        # the workload's optimizer class and settings, sharded
        probe = self.workload.make_optimizer([nn.Parameter(torch.zeros(1))], self.lr0)
        optimizer = ZeroRedundancyOptimizer(self.ddp.parameters(), optimizer_class=type(probe), **probe.defaults)
        if self.timer is not None:
            optimizer._sync_params = TimedSync(self.timer, optimizer)  # type: ignore[attr-defined]
        return optimizer

    def optimizer_state(self) -> list[Tensor]:
        assert isinstance(self.optimizer, ZeroRedundancyOptimizer)
        return state_tensors(self.optimizer.optim)  # the wrapped optimizer: this rank's shard of the parameters

    def describe(self) -> str:
        return "zero"
