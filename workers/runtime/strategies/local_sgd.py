"""Post-local SGD: ordinary DDP (all-reduce every step) for ``warmup_steps``, then every rank
steps its own model and the models are averaged every ``period`` steps (torch's
``post_localSGD_hook`` + ``PeriodicModelAverager``). After the warm-up the gradient hook does no
communication (``post_local_gradient_allreduce=False``); ``PostLocalSGDState`` still wants a
subgroup (its default, one per node of CUDA devices, refuses CPU): one rank per subgroup, from
``dist.new_subgroups``. The averaging all-reduce is timed through a stand-in for the averaging
module's ``dist`` (a blocking call: exposed)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.algorithms.model_averaging import utils as averaging_utils

from torchyard import spec as specs
from workers.runtime.comm import CommTimer, patch_dist, tensor_bytes
from workers.runtime.strategies.base import plain_step
from workers.runtime.strategies.ddp import DdpStrategy, Hook, as_hook
from workers.runtime.workloads import Batch, Workload


class LocalSgdStrategy(DdpStrategy):
    kind = "local_sgd"

    def __init__(
        self, cfg: specs.LocalSgdConfig, workload: Workload, device: torch.device, timer: CommTimer | None, lr: float
    ) -> None:
        self.local = cfg
        super().__init__(None, workload, device, timer, lr)
        self.averager = averagers.PeriodicModelAverager(period=cfg.period, warmup_steps=cfg.warmup_steps)
        if timer is not None:
            self._undo.append(patch_dist(averaging_utils, timer))

    def make_hook(self) -> tuple[Any, Hook, Any]:
        subgroup, _ = dist.new_subgroups(group_size=1)
        state = post_localSGD_hook.PostLocalSGDState(
            process_group=None,
            subgroup=subgroup,
            start_localSGD_iter=max(self.local.warmup_steps, 1),
            post_local_gradient_allreduce=False,
        )

        def nbytes(state: Any, bucket: Any) -> int:
            return tensor_bytes(bucket.buffer())

        return state, post_localSGD_hook.post_localSGD_hook, nbytes

    def timed(self, hook: Hook, nbytes: Any) -> Hook:
        timed_hook = super().timed(hook, nbytes)

        def local_or_timed(state: Any, bucket: Any) -> torch.futures.Future[Tensor]:
            if state.iter >= state.start_localSGD_iter:  # local phase: no communication at all
                return hook(state, bucket)
            return timed_hook(state, bucket)

        return as_hook(local_or_timed)

    def train_step(self, batch: Batch) -> Tensor:
        assert self.optimizer is not None
        loss = plain_step(self.ddp, self.optimizer, self.workload, batch)
        self.averager.average_parameters(self.ddp.parameters())
        return loss

    def describe(self) -> str:
        return f"local_sgd/H={self.local.period},warmup={self.local.warmup_steps}"
