"""Tensor parallelism (``tp``) and 2-D FSDP × TP (``fsdp_tp``) with ``torch.distributed.tensor.parallel``.

Each layer's weights are split across a tensor-parallel group (a ``DeviceMesh`` dim), Megatron-style:
a column-wise Linear (its output features split: no communication in forward) feeds a row-wise one
(its input features split: the partial outputs are summed, an all-reduce). So in the mlp the Linears
alternate column-, row-wise (an odd last one stays whole on every rank: its input is replicated), and
in each transformer block q, k, v are column-wise (each rank attends with whole heads of its own)
and the attention's output projection row-wise, as are the feed-forward's two Linears; the decoder
head is column-wise with its logits gathered. Sequence parallelism (charlm, ``sequence_parallel``):
between the blocks' TP regions the activations (LayerNorms, residual stream) stay split along the
sequence, so each row-wise all-reduce becomes a reduce-scatter and each TP region starts with an
all-gather. The embedding (and positions) stay whole on every rank. Every rank of a TP group
computes on the same batch and the same loss.

``nn.TransformerEncoderLayer`` keeps q, k and v in one packed ``in_proj_weight`` that the attention
kernel reads whole, which no parallel style can split; so for TP the charlm model is rebuilt from
the same weights as :class:`TpCharTransformer` (separate q, k, v Linears, torch's SDPA on the local
heads): the same function, step for step (tests compare it with the one-process run).

``fsdp_tp``: a (world / tp_degree) × tp_degree mesh, TP inside each group of consecutive ranks
(on GPUs, the fast links of a node), then FSDP2 (``fully_shard``) across the groups on the other
dim: a TP-split weight is sharded again, 2-D. The data set is split across the FSDP dim only.

Communication: DTensor issues its collectives through ``torch.distributed._functional_collectives``
(C++ ``_c10d_functional`` ops, never ``torch.distributed.all_reduce``), timed by
:func:`workers.runtime.comm.patch_functional_collectives`; FSDP's through its timed comm hooks
(``fsdp.shard``). Each is counted with its own group's size (the bus factor of a 2-D mesh's sub-group).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchyard import spec as specs
from workers.runtime.comm import CommTimer, patch_functional_collectives
from workers.runtime.strategies import fsdp
from workers.runtime.strategies.base import Strategy, plain_step
from workers.runtime.workloads import Batch, CharTransformer, Workload

# -- charlm, rebuilt with its attention's q, k, v apart ------------------------------------------


class TokenEmbedding(nn.Module):
    """Token embedding plus learned positions (whole on every rank)."""

    def __init__(self, embed: nn.Embedding, pos: nn.Parameter) -> None:
        super().__init__()
        self.embed, self.pos = embed, pos

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embed(tokens) + self.pos[: tokens.shape[1]]


class Attention(nn.Module):
    """``nn.MultiheadAttention`` (causal, batch first, no dropout) with q, k, v as Linears of their
    own, copied from its packed projection. Heads are read from the local width, so under TP each
    rank attends with the heads of its column shard."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        width, self.head_dim = mha.embed_dim, mha.head_dim
        assert mha.in_proj_weight is not None and mha.in_proj_bias is not None, "a packed q, k, v projection"
        device = mha.in_proj_weight.device
        self.q, self.k, self.v = (nn.Linear(width, width, device=device) for _ in range(3))
        with torch.no_grad():
            for linear, weight, bias in zip(
                (self.q, self.k, self.v), mha.in_proj_weight.chunk(3), mha.in_proj_bias.chunk(3), strict=True
            ):
                linear.weight.copy_(weight)
                linear.bias.copy_(bias)
        self.out = mha.out_proj

    def forward(self, x: Tensor) -> Tensor:
        batch, length = x.shape[0], x.shape[1]

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, length, -1, self.head_dim).transpose(1, 2)

        o = nn.functional.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True
        )
        return self.out(o.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, layer: nn.TransformerEncoderLayer) -> None:
        super().__init__()
        self.linear1, self.linear2, self.activation = layer.linear1, layer.linear2, layer.activation

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class Block(nn.Module):
    """A pre-norm ``nn.TransformerEncoderLayer`` (no dropout), from its own modules and weights."""

    def __init__(self, layer: nn.TransformerEncoderLayer) -> None:
        super().__init__()
        assert layer.norm_first, "charlm's layers are pre-norm"
        self.norm1, self.attn = layer.norm1, Attention(layer.self_attn)
        self.norm2, self.ff = layer.norm2, FeedForward(layer)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class TpCharTransformer(nn.Module):
    """:class:`CharTransformer`'s function and weights, in modules tensor parallelism can split."""

    def __init__(self, model: CharTransformer) -> None:
        super().__init__()
        self.embed = TokenEmbedding(model.embed, model.pos)
        self.blocks = nn.ModuleList(Block(layer) for layer in model.blocks.layers)  # type: ignore[arg-type]
        self.norm, self.head = model.norm, model.head

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


# -- the plans ------------------------------------------------------------------------------------


def mlp_plan(model: nn.Sequential) -> dict[str, ParallelStyle]:
    """Pairs of Linears: column-wise (its ReLU runs on the local features), then row-wise."""
    linears = [name for name, module in model.named_children() if isinstance(module, nn.Linear)]
    plan: dict[str, ParallelStyle] = {}
    for column, row in zip(linears[0::2], linears[1::2], strict=False):
        plan[column], plan[row] = ColwiseParallel(), RowwiseParallel()
    return plan


def charlm_plan(model: TpCharTransformer, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    sequence = Shard(1)  # (batch, sequence, features)
    for i in range(len(model.blocks)):
        block = f"blocks.{i}"
        for name in ("attn.q", "attn.k", "attn.v", "ff.linear1"):
            plan[f"{block}.{name}"] = ColwiseParallel()
        for name in ("attn.out", "ff.linear2"):  # sum the partial outputs: into the sequence shards, or whole
            plan[f"{block}.{name}"] = RowwiseParallel(output_layouts=sequence if sequence_parallel else Replicate())
        for norm, region in (("norm1", "attn"), ("norm2", "ff")):
            if sequence_parallel:
                plan[f"{block}.{norm}"] = SequenceParallel()
            # the region's input as one DTensor: sequence-parallel, all-gathered from the shards; else
            # whole already. Either way q, k and v share it, so their input gradients are summed
            # before the one collective that backward needs (a reduce-scatter, or an all-reduce)
            plan[f"{block}.{region}"] = PrepareModuleInput(
                input_layouts=(sequence if sequence_parallel else Replicate(),), desired_input_layouts=(Replicate(),)
            )
    if sequence_parallel:
        # the embedding's output is whole on every rank: each keeps its part of the sequence (no comm)
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=sequence)
        plan["norm"] = SequenceParallel()
    # the logits stay split over the vocabulary (a DTensor): the loss is computed on them in place
    # (``loss_parallel``), never gathered
    plan["head"] = ColwiseParallel(
        input_layouts=sequence if sequence_parallel else Replicate(), output_layouts=Shard(-1), use_local_output=False
    )
    return plan


def tensor_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """``model`` (a built-in workload's) split across the 1-D ``mesh`` by its plan."""
    if isinstance(model, CharTransformer):
        charlm = TpCharTransformer(model)
        # every rank built the same weights from the seed: each keeps its shard, nothing is sent
        return parallelize_module(charlm, mesh, charlm_plan(charlm, sequence_parallel), src_data_rank=None)
    if isinstance(model, nn.Sequential):
        return parallelize_module(model, mesh, mlp_plan(model), src_data_rank=None)
    raise ValueError(f"no tensor-parallel plan for a {type(model).__name__}")


# -- the strategies -------------------------------------------------------------------------------


class TpStrategy(Strategy):
    kind = "tp"

    def __init__(
        self,
        cfg: specs.TpConfig | specs.FsdpTpConfig,
        workload: Workload,
        device: torch.device,
        timer: CommTimer | None,
        lr: float,
    ) -> None:
        super().__init__(workload, device, timer, lr)
        self.cfg = cfg
        self.mesh = self.make_mesh(device)
        self.model = self.wrap(tensor_parallel(workload.model.to(device), self.mesh["tp"], cfg.sequence_parallel))
        if timer is not None:  # within a step only (not the set-up's)
            self._undo.append(patch_functional_collectives(lambda: timer if timer.step else None))
        self.optimizer = workload.make_optimizer(self.model.parameters(), lr)

    def make_mesh(self, device: torch.device) -> DeviceMesh:
        return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def data_shard(self, rank: int, world: int) -> tuple[int, int]:
        return 0, 1  # every rank of the group computes on the whole batch

    def train_step(self, batch: Batch) -> Tensor:
        assert self.optimizer is not None
        if not isinstance(self.model, TpCharTransformer):
            return plain_step(self.model, self.optimizer, self.workload, batch)
        with loss_parallel():  # cross-entropy on vocabulary-split logits: forward and backward
            loss = plain_step(self.model, self.optimizer, self.workload, batch)
        assert isinstance(loss, DTensor)
        return loss.to_local()  # replicated: every rank holds the whole loss

    def describe(self) -> str:
        return f"tp/degree={self.mesh['tp'].size()},sequence_parallel={self.cfg.sequence_parallel}"


class FsdpTpStrategy(TpStrategy):
    kind = "fsdp_tp"
    cfg: specs.FsdpTpConfig

    def make_mesh(self, device: torch.device) -> DeviceMesh:
        tp = self.cfg.tp_degree
        return init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))

    def wrap(self, model: nn.Module) -> nn.Module:
        units: list[Any] = list(model.blocks) if isinstance(model, TpCharTransformer) else fsdp.shard_units(model)
        fsdp.shard(model, units, self.mesh["dp"], self.cfg.reshard_after_forward, self.timer)
        return model

    def data_shard(self, rank: int, world: int) -> tuple[int, int]:
        dp = self.mesh["dp"]
        return dp.get_local_rank(), dp.size()

    def describe(self) -> str:
        return (
            f"fsdp_tp/mesh={self.mesh['dp'].size()}x{self.mesh['tp'].size()},"
            f"sequence_parallel={self.cfg.sequence_parallel},reshard_after_forward={self.cfg.reshard_after_forward}"
        )
