"""FSDP2 (``fully_shard``): each layer's parameters sharded across the ranks, all-gathered for
forward and backward, gradients reduce-scattered. The all-gathers and reduce-scatters go through
timed versions of FSDP's default comms (``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``). On CPU FSDP calls them synchronously: the call is the collective,
and the step waits for it (exposed). On CUDA it calls them synchronously too, but on side streams:
the events bracketing the call (recorded on that side stream) time the collective, and the exposed
part is what the compute stream waits for: events on the compute stream around FSDP's own waits
(each group's ``wait_for_unshard`` before it computes, and the root's end-of-backward wait for the
reduce-scatters). Bytes follow nccl-tests: the whole gathered buffer for an all-gather, the whole
input buffer for a reduce-scatter."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from torchyard import spec as specs
from workers.runtime.comm import ALL_GATHER, REDUCE_SCATTER, CommTimer, Mark, tensor_bytes
from workers.runtime.strategies.base import Strategy, plain_step
from workers.runtime.workloads import Batch, Workload


def _timed(timer: CommTimer, kind: str, nbytes: int, start: Mark, work: Any, group: Any) -> Any:
    ranks = group.size() if group is not None else 0  # FSDP's group: a 2-D mesh's data-parallel dim
    if work is None:  # synchronous: done (CPU) or enqueued in stream order (CUDA) when it returns
        end = timer.now()
        timer.add(kind, nbytes, start, end, ranks)
        if not timer.cuda:  # CUDA: a side stream's; the compute stream's waits are timed apart
            timer.add_exposed(start, end)
        return None

    def done(fut: torch.futures.Future[Any]) -> None:
        timer.add(kind, nbytes, start, timer.now(), ranks)

    work.get_future().then(done)  # FSDP waits on the Work itself (it checks its type): hand it back
    return work


def _expose_waits(owner: Any, method: str, timer: CommTimer) -> None:
    """CUDA: the compute stream's time inside one of FSDP's waits on its comm streams is exposed
    comm (events on the compute stream before and after the ``wait_event`` FSDP inserts; the
    all-gather's copy-out, queued there too, is counted with it)."""
    original = getattr(owner, method)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = timer.now()
        try:
            return original(*args, **kwargs)
        finally:
            timer.add_exposed(start, timer.now())

    setattr(owner, method, timed)


class TimedAllGather(DefaultAllGather):
    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False) -> Any:
        start = self.timer.now()
        work = super().__call__(output_tensor, input_tensor, group, async_op)
        return _timed(self.timer, ALL_GATHER, tensor_bytes(output_tensor), start, work, group)


class TimedReduceScatter(DefaultReduceScatter):
    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer

    def __call__(  # type: ignore[override]
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        start = self.timer.now()
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        return _timed(self.timer, REDUCE_SCATTER, tensor_bytes(input_tensor), start, work, group)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units (besides the root): layers with parameters."""
    if isinstance(model, nn.Sequential):
        return [m for m in model if any(True for _ in m.parameters())]
    return [m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]


def shard(
    model: nn.Module, units: list[nn.Module], mesh: DeviceMesh, reshard_after_forward: bool, timer: CommTimer | None
) -> None:
    """``fully_shard`` each of ``units``, then the root, across ``mesh`` (1-D), their collectives timed."""
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if timer is None:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(TimedAllGather(timer))
            module.set_custom_reduce_scatter(TimedReduceScatter(timer))
            if timer.cuda:
                state = module._get_fsdp_state()
                for group in state._fsdp_param_groups:
                    _expose_waits(group, "wait_for_unshard", timer)
                _expose_waits(state, "_root_post_backward_final_callback", timer)


class FsdpStrategy(Strategy):
    kind = "fsdp"

    def __init__(
        self, cfg: specs.FsdpConfig, workload: Workload, device: torch.device, timer: CommTimer | None, lr: float
    ) -> None:
        super().__init__(workload, device, timer, lr)
        self.cfg = cfg
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        model = workload.model.to(device)
        shard(model, shard_units(model), mesh, cfg.reshard_after_forward, timer)
        self.model = model
        self.optimizer = workload.make_optimizer(model.parameters(), lr)

    def train_step(self, batch: Batch) -> Tensor:
        assert self.optimizer is not None
        return plain_step(self.model, self.optimizer, self.workload, batch)

    def describe(self) -> str:
        return f"fsdp/reshard_after_forward={self.cfg.reshard_after_forward}"
