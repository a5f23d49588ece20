"""The one interface every strategy implements (see :func:`workers.runtime.strategies.build`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from workers.runtime.comm import CommTimer
from workers.runtime.workloads import Batch, Workload


class Strategy:
    """A way to train ``workload`` across the ranks of the default process group.

    ``train_step(batch)`` runs forward, backward and the optimizer step on this rank's batch and
    returns the loss (``None`` on a rank that computes none, e.g. a pipeline's first stage).
    ``timer`` (``None``: bare, uninstrumented) receives every collective the strategy issues.
    :meth:`data_shard` says which part of the data a rank reads."""

    kind = ""

    def __init__(self, workload: Workload, device: torch.device, timer: CommTimer | None, lr: float) -> None:
        self.workload, self.device, self.timer, self.lr0 = workload, device, timer, lr
        self._undo: list[Callable[[], None]] = []
        self.model: nn.Module = workload.model
        self.optimizer: torch.optim.Optimizer | None = None
        self._memory: dict[str, float] | None = None

    def train_step(self, batch: Batch) -> Tensor | None:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    def data_shard(self, rank: int, world: int) -> tuple[int, int]:
        """(the data shard this rank reads, how many shards the data set is cut into): the global
        batch is split across the shards, and ranks given the same shard read the same samples
        (a pipeline's stages, a tensor-parallel group). By default every rank reads its own."""
        return rank, world

    def extra_metrics(self) -> dict[str, float]:
        """Strategy-specific figures for the step just finished (none by default)."""
        return {}

    def memory_figures(self) -> dict[str, float]:
        """What this rank holds of the model: ``param_bytes`` (its parameters: all of them under
        DDP, its shard under FSDP and TP, its stage in a pipeline) and, once the optimizer has
        stepped, ``optimizer_state_bytes`` (ZeRO: its shard's). Sizes never change after the first
        step, so they are worked out once."""
        if self._memory is None or "optimizer_state_bytes" not in self._memory:
            figures = {"param_bytes": float(local_bytes(self.model.parameters()))}
            state = self.optimizer_state()
            if state:
                figures["optimizer_state_bytes"] = float(local_bytes(state))
            self._memory = figures
        return self._memory

    def optimizer_state(self) -> list[Tensor]:
        """The tensors of the optimizer's state that this rank holds."""
        return state_tensors(self.optimizer) if self.optimizer is not None else []

    def state_dict(self) -> dict[str, Any]:
        """What this rank puts in a checkpoint (``workers.runtime.checkpoint``; an entry that several
        ranks hold alike, a replicated weight, is written once): the model and the optimizer."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # see checkpoint.py's imports

        model, optim = get_state_dict(self.model, self.optimizer)  # type: ignore[arg-type]
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave, once the checkpoint filled it in."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])  # type: ignore[arg-type]

    def describe(self) -> str:
        return self.kind

    def close(self) -> None:
        """Undo what the strategy patched (timed ``dist`` stand-ins) in torch's modules."""
        while self._undo:
            self._undo.pop()()


def state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, Tensor)]


def local_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the tensors as this rank holds them (a DTensor: its local shard)."""
    # No tensor is a DTensor unless its module was loaded (by tp or fsdp): importing it here would
    # cost every rank of every run its start-up (see checkpoint.py's imports).
    dtensor = sys.modules.get("torch.distributed.tensor")
    total = 0
    for t in tensors:
        local = t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t
        total += local.numel() * local.element_size()
    return total


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload, batch: Batch) -> Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = workload.loss(model, batch)
    loss.backward()
    optimizer.step()
    return loss
