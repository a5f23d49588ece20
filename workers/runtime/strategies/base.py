"""The one interface every strategy implements (see :func:`workers.runtime.strategies.build`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from workers.runtime.comm import CommTimer
from workers.runtime.workloads import Batch, Workload


class Strategy:
    """A way to train ``workload`` across the ranks of the default process group.

    ``train_step(batch)`` runs forward, backward and the optimizer step on this rank's batch and
    returns the loss (``None`` on a rank that computes none, e.g. a pipeline's first stage).
    ``timer`` (``None``: bare, uninstrumented) receives every collective the strategy issues.
    ``data_parallel``: each rank reads its own shard (else every rank reads the whole batch)."""

    kind = ""
    data_parallel = True

    def __init__(self, workload: Workload, device: torch.device, timer: CommTimer | None, lr: float) -> None:
        self.workload, self.device, self.timer, self.lr0 = workload, device, timer, lr
        self._undo: list[Callable[[], None]] = []
        self.model: nn.Module = workload.model
        self.optimizer: torch.optim.Optimizer | None = None

    def train_step(self, batch: Batch) -> Tensor | None:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    def extra_metrics(self) -> dict[str, float]:
        """Strategy-specific figures for the step just finished (none by default)."""
        return {}

    def describe(self) -> str:
        return self.kind

    def close(self) -> None:
        """Undo what the strategy patched (timed ``dist`` stand-ins) in torch's modules."""
        while self._undo:
            self._undo.pop()()


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload, batch: Batch) -> Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = workload.loss(model, batch)
    loss.backward()
    optimizer.step()
    return loss
