"""The run spec: what a user submits. Validated at submit (a bad spec is a 422 that names the
field and the value) and handed unchanged to the ranks, which read it back with the same models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MlpParams(_Strict):
    input_dim: int = Field(32, ge=1, le=65536)
    hidden: int = Field(128, ge=1, le=65536)
    layers: int = Field(3, ge=1, le=64, description="hidden layers")
    classes: int = Field(10, ge=2, le=65536)
    samples: int = Field(8192, ge=1, description="synthetic data set size")


class CharLMParams(_Strict):
    d_model: int = Field(64, ge=8, le=4096)
    n_layers: int = Field(2, ge=1, le=48)
    n_heads: int = Field(4, ge=1, le=64)
    seq_len: int = Field(64, ge=8, le=4096)
    corpus_bytes: int = Field(2_000_000, ge=10_000, description="bytes of stdlib source to train on")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> CharLMParams:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self


class MlpWorkload(_Strict):
    kind: Literal["builtin"] = "builtin"
    name: Literal["mlp"]
    params: MlpParams = MlpParams()


class CharLMWorkload(_Strict):
    kind: Literal["builtin"] = "builtin"
    name: Literal["charlm"]
    params: CharLMParams = CharLMParams()


class FailParams(_Strict):
    at_step: int = Field(1, ge=1, description="the step at which it fails")
    rank: int | None = Field(None, ge=0, description="only this rank fails (default: every rank)")
    times: int = Field(0, ge=0, description="fail only in the first N starts of the ranks (0: every start)")
    hang: bool = Field(False, description="hang (stop stepping) instead of raising")


class FailWorkload(_Strict):
    """Raises (or hangs) at the given step: shows how a failing or hung run looks, how torch
    elastic restarts a crashed rank, how the watchdog finds a stall (and tests them)."""

    kind: Literal["builtin"] = "builtin"
    name: Literal["fail"]
    params: FailParams = FailParams()


BUNDLE_ID = r"^[0-9a-f]{64}$"


class ScriptWorkload(_Strict):
    """The user's own code: an uploaded bundle (``POST /api/v1/bundles``) whose ``entry`` script
    runs as ``torchrun`` would run it, with ``args``. The script does its own parallelism (the
    strategy must stay the default); step time, throughput and DDP communication are measured
    without it changing a line, and whatever it logs with ``torchyard.log`` is kept too."""

    kind: Literal["script"] = "script"
    name: Literal["script"] = "script"
    bundle: str = Field(..., pattern=BUNDLE_ID, description="the bundle's id (its sha256), from POST /api/v1/bundles")
    entry: str = Field(..., min_length=1, max_length=1000, description="the script to run, a path inside the bundle")
    args: list[Annotated[str, Field(max_length=10_000)]] = Field(
        default_factory=list, max_length=1000, description="its command-line arguments"
    )

    @model_validator(mode="after")
    def _entry_inside_bundle(self) -> ScriptWorkload:
        parts = self.entry.replace("\\", "/").split("/")
        if self.entry.startswith("/") or ".." in parts or not self.entry.endswith(".py"):
            raise ValueError(f"workload.entry ({self.entry!r}) must be a relative path to a .py file inside the bundle")
        return self


Workload = Annotated[MlpWorkload | CharLMWorkload | FailWorkload | ScriptWorkload, Field(discriminator="name")]


class DdpStrategy(_Strict):
    """DistributedDataParallel with one of torch's gradient communication hooks."""

    kind: Literal["ddp"]
    comm_hook: Literal["allreduce", "fp16", "bf16", "powersgd"] = "allreduce"
    powersgd_rank: int = Field(2, description="PowerSGD's matrix approximation rank (≥ 1)")
    powersgd_warmup: int = Field(10, ge=0, description="steps of plain all-reduce before PowerSGD starts (≥ 2)")

    @model_validator(mode="after")
    def _powersgd_fits(self) -> DdpStrategy:
        if self.powersgd_rank < 1:
            raise ValueError(f"strategy.powersgd_rank ({self.powersgd_rank}) must be at least 1")
        if self.comm_hook == "powersgd" and self.powersgd_warmup < 2:
            raise ValueError(
                f"strategy.powersgd_warmup ({self.powersgd_warmup}) must be at least 2: PowerSGD with error "
                "feedback starts after DDP's first two steps (torch's start_powerSGD_iter > 1)"
            )
        return self


class FsdpStrategy(_Strict):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters sharded across the ranks."""

    kind: Literal["fsdp"]
    reshard_after_forward: bool = True


class PipelineStrategy(_Strict):
    """``torch.distributed.pipelining``: one stage per rank, the global batch cut in microbatches."""

    kind: Literal["pipeline"]
    stages: int | None = Field(None, description="pipeline stages; default (and the only choice): the world size")
    microbatches: int = Field(4, ge=1)
    schedule: Literal["gpipe", "1f1b"] = "gpipe"


class LocalSgdStrategy(_Strict):
    """Post-local SGD: DDP for ``warmup_steps``, then local steps with the models averaged every ``period``."""

    kind: Literal["local_sgd"]
    period: int = Field(4, ge=1, description="average the models every H steps")
    warmup_steps: int = Field(10, ge=0, description="steps of ordinary DDP before local SGD starts")


class ZeroStrategy(_Strict):
    """DDP with ``ZeroRedundancyOptimizer``: optimizer state sharded across the ranks."""

    kind: Literal["zero"]


Strategy = Annotated[
    DdpStrategy | FsdpStrategy | PipelineStrategy | LocalSgdStrategy | ZeroStrategy, Field(discriminator="kind")
]


class Resources(_Strict):
    nodes: int = Field(1, ge=1, le=64, description="nodes placed together: all at once or not at all (gang)")
    procs_per_node: int = Field(1, ge=1, le=256)
    device: Literal["cpu", "cuda"] = "cpu"
    priority: int = Field(0, ge=-100, le=100, description="higher runs first")


class Training(_Strict):
    steps: int = Field(100, ge=1, le=100_000_000)
    batch_size: int = Field(64, ge=1, description="global batch, split evenly across ranks")
    lr: float = Field(0.01, gt=0, le=100)
    seed: int = Field(0, ge=0)
    log_every: int = Field(1, ge=1, description="log metrics every N steps")
    profile_every: int = Field(
        0,
        ge=0,
        description="every N steps one step runs under torch.profiler: trace-derived comm/overlap figures "
        "(prof_*) and a timeline on the run page (0: never)",
    )
    checkpoint_every: int = Field(0, ge=0, description="save a checkpoint every N steps (0: never)")
    max_attempts: int = Field(3, ge=1, le=100, description="attempts before a run whose node is lost fails")
    max_restarts: int = Field(
        0, ge=0, le=100, description="times torch elastic restarts a node's ranks after one crashes, within an attempt"
    )
    stall_timeout_s: float = Field(
        0,
        ge=0,
        description="no step for this long (counted from an attempt's first step): restart from the last checkpoint "
        "(0: never)",
    )
    max_duration_s: float = Field(0, ge=0, description="stop the run after running this long (0: no limit)")
    checkpoint_on_cancel: bool = Field(
        False, description="on cancel, every rank saves a checkpoint at the step boundary before it exits (ddp, fsdp)"
    )
    cancel_grace_s: float | None = Field(
        None,
        ge=0,
        le=86_400,
        description="seconds the ranks get between SIGTERM and SIGKILL on cancel (default: TORCHYARD_CANCEL_GRACE_S, "
        "and at least 120 with checkpoint_on_cancel: the save must fit in it)",
    )


class RunSpec(_Strict):
    name: str = Field(..., min_length=1, max_length=200)
    workload: Workload
    strategy: Strategy = DdpStrategy(kind="ddp")
    resources: Resources = Resources()
    training: Training = Training()

    @model_validator(mode="before")
    @classmethod
    def _script_needs_no_name(cls, data: object) -> object:
        """``{"kind": "script", ...}`` is enough: the union is told apart by ``name``."""
        w = data.get("workload") if isinstance(data, dict) else None
        if isinstance(data, dict) and isinstance(w, dict) and w.get("kind") == "script" and "name" not in w:
            data = {**data, "workload": {**w, "name": "script"}}
        return data

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.procs_per_node

    @model_validator(mode="after")
    def _batch_splits_across_ranks(self) -> RunSpec:
        if isinstance(self.workload, ScriptWorkload):
            if not isinstance(self.strategy, DdpStrategy) or self.strategy.comm_hook != "allreduce":
                raise ValueError(
                    f"strategy.kind '{self.strategy.kind}' does not apply to workload.kind 'script': the script "
                    "does its own parallelism (leave strategy out)"
                )
            if self.training.checkpoint_every:
                raise ValueError(
                    f"training.checkpoint_every ({self.training.checkpoint_every}) does not apply to workload.kind "
                    "'script': a script saves its own checkpoints (a new attempt runs it again from the start)"
                )
            if self.training.profile_every:
                raise ValueError(
                    f"training.profile_every ({self.training.profile_every}) does not apply to workload.kind 'script' "
                    "yet: profile a step of your script with torch.profiler yourself"
                )
            if self.training.checkpoint_on_cancel:
                raise ValueError(
                    "training.checkpoint_on_cancel (true) does not apply to workload.kind 'script': a script saves "
                    "its own checkpoints (it gets SIGTERM, then SIGKILL after training.cancel_grace_s)"
                )
            return self
        if self.training.batch_size % self.world_size:
            raise ValueError(
                f"training.batch_size ({self.training.batch_size}) must be divisible by "
                f"nodes × procs_per_node ({self.world_size})"
            )
        if isinstance(self.workload, MlpWorkload) and self.workload.params.samples < self.training.batch_size:
            raise ValueError(
                f"workload.params.samples ({self.workload.params.samples}) must be at least "
                f"training.batch_size ({self.training.batch_size})"
            )
        self._strategy_fits()
        if self.training.checkpoint_every and not isinstance(self.strategy, DdpStrategy | FsdpStrategy):
            raise ValueError(
                f"training.checkpoint_every ({self.training.checkpoint_every}) is available for the ddp and fsdp "
                f"strategies, not {self.strategy.kind!r} yet"
            )
        if self.training.checkpoint_on_cancel and not isinstance(self.strategy, DdpStrategy | FsdpStrategy):
            raise ValueError(
                f"training.checkpoint_on_cancel (true) is available for the ddp and fsdp strategies, not "
                f"{self.strategy.kind!r} yet"
            )
        return self

    def _strategy_fits(self) -> None:
        """Refuse, quoting the values, a strategy that cannot work for this workload and world."""
        s, world = self.strategy, self.world_size
        if isinstance(s, FsdpStrategy | ZeroStrategy | LocalSgdStrategy | PipelineStrategy) and world < 2:
            raise ValueError(
                f"strategy.kind '{s.kind}' shards or averages across ranks: it needs nodes × procs_per_node "
                f"({world}) of at least 2"
            )
        if isinstance(s, PipelineStrategy):
            stages = s.stages if s.stages is not None else world
            if stages != world:
                raise ValueError(f"strategy.stages ({stages}) must equal nodes × procs_per_node ({world})")
            blocks = pipeline_blocks(self.workload)
            if stages > blocks:
                raise ValueError(
                    f"strategy.stages ({stages}) do not divide workload '{self.workload.name}': it splits into at "
                    f"most {blocks} stages"
                )
            if self.training.batch_size % s.microbatches:
                raise ValueError(
                    f"training.batch_size ({self.training.batch_size}) must be divisible by strategy.microbatches "
                    f"({s.microbatches})"
                )
            if s.schedule == "1f1b" and s.microbatches < stages:
                raise ValueError(
                    f"strategy.schedule '1f1b' needs strategy.microbatches ({s.microbatches}) ≥ stages ({stages})"
                )


def pipeline_blocks(workload: MlpWorkload | CharLMWorkload | FailWorkload | ScriptWorkload) -> int:
    """How many pipeline stages a built-in model splits into at most (whole layers per stage)."""
    if isinstance(workload, MlpWorkload):
        return workload.params.layers + 1  # each hidden Linear+ReLU, then the output Linear
    if isinstance(workload, CharLMWorkload):
        return workload.params.n_layers  # the first stage also embeds; the last also norms and decodes
    return 2  # fail: a one-hidden-layer mlp
