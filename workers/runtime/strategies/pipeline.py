"""Pipeline parallelism (``torch.distributed.pipelining``): one stage per rank, the global batch
cut into microbatches, a GPipe or 1F1B schedule. Every rank reads the whole global batch (stage 0
feeds the inputs, the last stage the targets); the loss exists on the last stage only.

The built-in models split into whole layers (:func:`stage_modules`). The schedule's sends and
receives are timed by wrapping its ``_batch_p2p`` (every batch of P2P ops goes through it): each
op's interval runs from its post to its completion, and the time the schedule spends in ``wait()``
is exposed (Gloo's send/recv have no future: the interval ends when ``wait()`` returns).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining import schedules as schedules_module

from torchyard import spec as specs
from workers.runtime.comm import SEND_RECV, CommTimer, tensor_bytes
from workers.runtime.strategies.base import Strategy
from workers.runtime.workloads import Batch, CharTransformer, Workload


def _split(count: int, parts: int) -> list[range]:
    """``count`` items in ``parts`` contiguous runs, sizes differing by at most one."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class _CharStage(nn.Module):
    """Layers ``layers`` of a :class:`CharTransformer`; the first stage embeds, the last decodes."""

    def __init__(self, model: CharTransformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.pos = model.embed, model.pos
        self.layers = nn.ModuleList(model.blocks.layers[i] for i in layers)
        if last:
            self.norm, self.head = model.norm, model.head

    def forward(self, h: Tensor) -> Tensor:
        if self.first:
            h = self.embed(h) + self.pos[: h.shape[1]]
        length = h.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=h.device)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h)) if self.last else h


def stage_modules(model: nn.Module, stages: int, blocks: int) -> list[nn.Module]:
    """The model cut into ``stages`` modules of whole layers. ``blocks``, how many whole layers the
    model has, comes from the spec's one rule (``torchyard.spec.pipeline_blocks``), which also
    refused any split that cannot work at submit; the model's own structure must agree with it."""
    if isinstance(model, nn.Sequential):
        layers: list[list[nn.Module]] = []
        for child in model:  # a Linear starts a block; activations join the block before them
            if isinstance(child, nn.Linear) or not layers:
                layers.append([child])
            else:
                layers[-1].append(child)
        assert len(layers) == blocks, f"the model has {len(layers)} blocks, the spec's rule says {blocks}"
        return [nn.Sequential(*(m for b in r for m in layers[b])) for r in _split(blocks, stages)]
    if isinstance(model, CharTransformer):
        assert len(model.blocks.layers) == blocks, f"{len(model.blocks.layers)} layers, the spec's rule says {blocks}"
        return [_CharStage(model, r, i == 0, i == stages - 1) for i, r in enumerate(_split(blocks, stages))]
    raise ValueError(f"a {type(model).__name__} does not split into pipeline stages")


class PipelineStrategy(Strategy):
    kind = "pipeline"

    def __init__(
        self,
        cfg: specs.PipelineConfig,
        spec: specs.RunSpec,
        workload: Workload,
        device: torch.device,
        timer: CommTimer | None,
        lr: float,
    ) -> None:
        super().__init__(workload, device, timer, lr)
        self.cfg = cfg
        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank, self.stages = rank, world
        module = stage_modules(workload.model, world, specs.pipeline_blocks(spec.workload))[rank].to(device)
        self.model = module
        self.stage = PipelineStage(module, rank, world, device)
        assert workload.criterion is not None, f"workload {workload.name} has no criterion for a pipeline"
        schedule = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
        self.schedule = schedule(self.stage, n_microbatches=cfg.microbatches, loss_fn=workload.criterion)
        self.optimizer = workload.make_optimizer(module.parameters(), lr)
        if timer is not None:
            original = schedules_module._batch_p2p

            def timed_batch_p2p(p2p_ops: list[dist.P2POp], desc: str | None = None) -> list[Any]:
                start = timer.now()
                works = original(p2p_ops, desc)
                sizes = [tensor_bytes(op.tensor) for op in p2p_ops]
                if len(works) != len(sizes):  # coalesced: one work for the batch
                    sizes = [sum(sizes)] + [0] * (len(works) - 1)
                return [timer.work(SEND_RECV, size, start, w) for w, size in zip(works, sizes, strict=True)]

            schedules_module._batch_p2p = timed_batch_p2p

            def undo() -> None:
                schedules_module._batch_p2p = original

            self._undo.append(undo)

    def data_shard(self, rank: int, world: int) -> tuple[int, int]:
        return 0, 1  # the first stage feeds the inputs of the whole global batch, the last its targets

    def train_step(self, batch: Batch) -> Tensor | None:
        assert self.optimizer is not None
        x, y = batch
        self.optimizer.zero_grad(set_to_none=True)
        last = self.rank == self.stages - 1
        losses: list[Tensor] = []
        if self.rank == 0:
            self.schedule.step(x)
        elif last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.optimizer.step()
        return torch.stack(losses).mean() if last else None

    def describe(self) -> str:
        return f"pipeline/{self.cfg.schedule},stages={self.stages},microbatches={self.cfg.microbatches}"
