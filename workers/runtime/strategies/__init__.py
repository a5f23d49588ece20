"""Training strategies behind one interface: ``build(spec, workload, device, timer) -> Strategy``.

Each strategy lives in its own module and reports every collective it issues to the
:class:`~workers.runtime.comm.CommTimer` it is given (``None``: run bare, for overhead benchmarks).
"""

from __future__ import annotations

import torch

from torchyard import spec as specs
from workers.runtime.comm import CommTimer
from workers.runtime.strategies.base import Strategy
from workers.runtime.workloads import Workload


def build(
    spec: specs.RunSpec, workload: Workload, device: torch.device, timer: CommTimer | None, ddp_logging: bool = False
) -> Strategy:
    """The strategy ``spec.strategy`` names, wrapped around ``workload`` on the default process group."""
    s, lr = spec.strategy, spec.training.lr
    if isinstance(s, specs.DdpStrategy):
        from workers.runtime.strategies.ddp import DdpStrategy

        return DdpStrategy(s, workload, device, timer, lr, ddp_logging=ddp_logging)
    if isinstance(s, specs.ZeroStrategy):
        from workers.runtime.strategies.zero import ZeroStrategy

        return ZeroStrategy(workload, device, timer, lr)
    if isinstance(s, specs.LocalSgdStrategy):
        from workers.runtime.strategies.local_sgd import LocalSgdStrategy

        return LocalSgdStrategy(s, workload, device, timer, lr)
    if isinstance(s, specs.FsdpStrategy):
        from workers.runtime.strategies.fsdp import FsdpStrategy

        return FsdpStrategy(s, workload, device, timer, lr)
    if isinstance(s, specs.PipelineStrategy):
        from workers.runtime.strategies.pipeline import PipelineStrategy

        return PipelineStrategy(s, spec, workload, device, timer, lr)
    raise ValueError(f"unknown strategy {s.kind!r}")


__all__ = ["Strategy", "build"]
