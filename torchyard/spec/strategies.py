"""How a run spreads its training over the ranks (``strategy``): one model per kind."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, model_validator

from torchyard.spec.base import MAX_STEPS, _Strict


class DdpConfig(_Strict):
    """DistributedDataParallel with one of torch's gradient communication hooks."""

    kind: Literal["ddp"]
    comm_hook: Literal["allreduce", "fp16", "bf16", "powersgd"] = "allreduce"
    powersgd_rank: int = Field(2, le=1024, description="PowerSGD's matrix approximation rank (≥ 1)")
    powersgd_warmup: int = Field(
        10, ge=0, le=MAX_STEPS, description="steps of plain all-reduce before PowerSGD starts (≥ 2)"
    )

    @model_validator(mode="after")
    def _powersgd_fits(self) -> DdpConfig:
        if self.powersgd_rank < 1:
            raise ValueError(f"strategy.powersgd_rank ({self.powersgd_rank}) must be at least 1")
        if self.comm_hook == "powersgd" and self.powersgd_warmup < 2:
            raise ValueError(
                f"strategy.powersgd_warmup ({self.powersgd_warmup}) must be at least 2: PowerSGD with error "
                "feedback starts after DDP's first two steps (torch's start_powerSGD_iter > 1)"
            )
        return self


class FsdpConfig(_Strict):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters sharded across the ranks."""

    kind: Literal["fsdp"]
    reshard_after_forward: bool = True


class PipelineConfig(_Strict):
    """``torch.distributed.pipelining``: one stage per rank, the global batch cut in microbatches."""

    kind: Literal["pipeline"]
    stages: int | None = Field(
        None, le=2**16, description="pipeline stages; default (and the only choice): the world size"
    )
    microbatches: int = Field(4, ge=1, le=4096)
    schedule: Literal["gpipe", "1f1b"] = "gpipe"


class LocalSgdConfig(_Strict):
    """Post-local SGD: DDP for ``warmup_steps``, then local steps with the models averaged every ``period``."""

    kind: Literal["local_sgd"]
    period: int = Field(4, ge=1, le=MAX_STEPS, description="average the models every H steps")
    warmup_steps: int = Field(10, ge=0, le=MAX_STEPS, description="steps of ordinary DDP before local SGD starts")


class ZeroConfig(_Strict):
    """DDP with ``ZeroRedundancyOptimizer``: optimizer state sharded across the ranks."""

    kind: Literal["zero"]


_SEQUENCE_PARALLEL = (
    "charlm: the LayerNorms and the residual stream between the tensor-parallel blocks split along the sequence "
    "(all-gather / reduce-scatter instead of all-reduce; seq_len divisible by the TP degree). mlp: no sequence, "
    "no effect"
)


class TpConfig(_Strict):
    """Tensor parallelism (``torch.distributed.tensor.parallel``): each layer's weights split across
    all the ranks (column-wise, then row-wise), every rank on the whole batch."""

    kind: Literal["tp"]
    sequence_parallel: bool = Field(True, description=_SEQUENCE_PARALLEL)


class FsdpTpConfig(_Strict):
    """2-D parallelism: ranks in a (world / tp_degree) × tp_degree mesh; tensor parallelism inside
    each group of ``tp_degree`` consecutive ranks, FSDP2 across the groups."""

    kind: Literal["fsdp_tp"]
    tp_degree: int = Field(2, le=2**16, description="ranks per tensor-parallel group (≥ 2; divides the world size)")
    sequence_parallel: bool = Field(True, description=_SEQUENCE_PARALLEL)
    reshard_after_forward: bool = True


class AsyncConfig(_Strict):
    """Parameter-server training with bounded staleness: rank 0 holds the model and the optimizer
    and applies gradients as they arrive; ranks 1.. are workers that push gradients and pull
    parameters with no barrier between them."""

    kind: Literal["async"]
    max_staleness: int = Field(
        4,
        ge=0,
        le=MAX_STEPS,
        description="how many versions (applied gradients) a worker's gradient may lag the server's parameters "
        "when it is applied; a worker that would be further ahead waits. 0: synchronous (the server averages "
        "one gradient from every worker per version, as DDP does); otherwise at least the workers − 1",
    )


StrategyConfig = Annotated[
    DdpConfig | FsdpConfig | PipelineConfig | LocalSgdConfig | ZeroConfig | TpConfig | FsdpTpConfig | AsyncConfig,
    Field(discriminator="kind"),
]


def strategy_kinds() -> list[str]:
    """Every ``strategy.kind`` a spec may name, in the union's order."""
    union = get_args(StrategyConfig)[0]
    return [get_args(config.model_fields["kind"].annotation)[0] for config in get_args(union)]
