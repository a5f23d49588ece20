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
    spec: specs.RunSpec,
    workload: Workload,
    device: torch.device,
    timer: CommTimer | None,
    ddp_logging: bool = False,
    slow_peer_s: float = 0.0,
    schedule_seed: int | None = None,
) -> Strategy:
    """The strategy ``spec.strategy`` names, wrapped around ``workload`` on the default process group.
    ``ddp_logging``, ``slow_peer_s`` and ``schedule_seed`` are for tests (DDP's own timers every step; a
    late last rank; ``async``'s updates in an order drawn from the seed, not as they arrive)."""
    s, lr = spec.strategy, spec.training.lr
    if isinstance(s, specs.DdpConfig):
        from workers.runtime.strategies.ddp import DdpStrategy

        return DdpStrategy(s, workload, device, timer, lr, ddp_logging=ddp_logging, slow_peer_s=slow_peer_s)
    if isinstance(s, specs.ZeroConfig):
        from workers.runtime.strategies.zero import ZeroStrategy

        return ZeroStrategy(workload, device, timer, lr)
    if isinstance(s, specs.LocalSgdConfig):
        from workers.runtime.strategies.local_sgd import LocalSgdStrategy

        return LocalSgdStrategy(s, workload, device, timer, lr)
    if isinstance(s, specs.FsdpConfig):
        from workers.runtime.strategies.fsdp import FsdpStrategy

        return FsdpStrategy(s, workload, device, timer, lr)
    if isinstance(s, specs.TpConfig):
        from workers.runtime.strategies.tp import TpStrategy

        return TpStrategy(s, workload, device, timer, lr)
    if isinstance(s, specs.FsdpTpConfig):
        from workers.runtime.strategies.tp import FsdpTpStrategy

        return FsdpTpStrategy(s, workload, device, timer, lr)
    if isinstance(s, specs.PipelineConfig):
        from workers.runtime.strategies.pipeline import PipelineStrategy

        return PipelineStrategy(s, spec, workload, device, timer, lr)
    if isinstance(s, specs.AsyncConfig):
        from workers.runtime.strategies.async_ps import AsyncStrategy

        return AsyncStrategy(s, spec.training, workload, device, timer, lr, schedule_seed=schedule_seed)
    raise ValueError(f"unknown strategy {s.kind!r}")


__all__ = ["Strategy", "build"]
