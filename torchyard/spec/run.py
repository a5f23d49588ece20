"""The whole run spec (``RunSpec``): its resources, data and training sections, and the checks that
span sections (a strategy against the workload and the world size)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from torchyard.datasets import NAME as DATASET_NAME
from torchyard.spec.base import MAX_ACTIVATIONS, MAX_SECONDS, MAX_STEPS, _Strict
from torchyard.spec.strategies import (
    AsyncConfig,
    DdpConfig,
    FsdpConfig,
    FsdpTpConfig,
    LocalSgdConfig,
    PipelineConfig,
    StrategyConfig,
    TpConfig,
    ZeroConfig,
)
from torchyard.spec.workloads import FAIL_MLP, CharLMConfig, FailConfig, MlpConfig, ScriptConfig, WorkloadConfig


class ResourcesConfig(_Strict):
    nodes: int = Field(1, ge=1, le=64, description="nodes placed together: all at once or not at all (gang)")
    procs_per_node: int = Field(1, ge=1, le=256)
    device: Literal["cpu", "cuda"] = "cpu"
    priority: int = Field(
        0,
        ge=-100,
        le=100,
        description="higher runs first; above TORCHYARD_MAX_MEMBER_PRIORITY (default 0) only an admin may set it",
    )
    pool: str | None = Field(
        None,
        pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$",
        description="the pool the run goes to (TORCHYARD_POOLS): the built-in workers or a Slurm cluster; "
        "empty: the default pool",
    )
    partition: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="a Slurm pool's partition for this run; empty: the pool's own",
    )
    memory_limit_bytes: int | None = Field(
        None,
        ge=64 * 2**20,
        le=2**50,
        description="memory the run may take on each node (all its processes there together); past it the kernel "
        "kills one of them and the run fails saying so; empty: the node's cap (TORCHYARD_RUN_MAX_MEMORY_BYTES)",
    )


class DataConfig(_Strict):
    """A registered dataset the run reads (``torchyard dataset create``): every rank reads its own
    samples of one global order per (seed, epoch), all ranks the same number of steps, and the data
    position is saved in every checkpoint (a resumed attempt goes on with the next unseen sample,
    at any world size). Built-in workloads read it instead of their generated data; a script reads
    it with ``torchyard.data.loader`` (README "Datasets")."""

    dataset: str = Field(..., pattern=DATASET_NAME, description="the dataset's name (GET /api/v1/datasets)")
    shuffle_buffer: int = Field(
        10_000,
        ge=0,
        le=1_000_000,
        description="samples shuffled together: the epoch's order is the shards in a random order, then each "
        "window of this many samples shuffled (0: no shuffle, the stored order)",
    )
    workers: int = Field(
        2, ge=0, le=32, description="loader processes per rank that read and decode ahead (0: in the rank itself)"
    )
    on_bad_shard: Literal["fail", "skip"] = Field(
        "fail",
        description="a shard that is missing, truncated or fails its checksums: fail the run naming it, or skip "
        "it (its unreadable samples left out, the rest of the batch repeated in their place) and count it in the "
        "rank's bad_shards and bad_samples metrics",
    )


CHECKPOINT_ON_CANCEL_GRACE_S = 120.0  # the least cancel grace when ranks save on cancel: the save must fit


class TrainingConfig(_Strict):
    steps: int = Field(100, ge=1, le=MAX_STEPS)
    batch_size: int = Field(64, ge=1, le=2**20, description="global batch, split evenly across ranks")
    lr: float = Field(0.01, gt=0, le=100)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    log_every: int = Field(1, ge=1, le=MAX_STEPS, description="log metrics every N steps")
    profile_every: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="every N steps one step runs under torch.profiler: trace-derived comm/overlap figures "
        "(prof_*) and a timeline on the run page (0: never)",
    )
    checkpoint_every: int = Field(0, ge=0, le=MAX_STEPS, description="save a checkpoint every N steps (0: never)")
    checkpoint_final: bool = Field(
        True,
        description="with checkpoint_every set, save at the last step too, so the final weights are kept "
        "(false: only every N steps before the last)",
    )
    max_attempts: int = Field(3, ge=1, le=100, description="attempts before a run whose node is lost fails")
    max_restarts: int = Field(
        0, ge=0, le=100, description="times torch elastic restarts a node's ranks after one crashes, within an attempt"
    )
    stall_timeout_s: float = Field(
        0,
        ge=0,
        le=MAX_SECONDS,
        description="no step for this long (counted from an attempt's first step): restart from the last checkpoint "
        "(0: never)",
    )
    max_duration_s: float = Field(
        0, ge=0, le=MAX_SECONDS, description="stop the run after running this long (0: no limit; at most 30 days)"
    )
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

    def cancel_grace(self, default_s: float) -> float:
        """SIGTERM → SIGKILL grace on cancel (the worker's, and what the scheduler waits for):
        ``cancel_grace_s``, else ``default_s`` (TORCHYARD_CANCEL_GRACE_S), at least
        CHECKPOINT_ON_CANCEL_GRACE_S when the ranks save on cancel."""
        if self.cancel_grace_s is not None:
            return self.cancel_grace_s
        if self.checkpoint_on_cancel:
            return max(default_s, CHECKPOINT_ON_CANCEL_GRACE_S)
        return default_s


class RunSpec(_Strict):
    name: str | None = Field(
        None, min_length=1, max_length=200, description="default: workload-strategy, e.g. mlp-ddp (a script: its entry)"
    )
    workload: WorkloadConfig
    strategy: StrategyConfig = DdpConfig(kind="ddp")
    resources: ResourcesConfig = ResourcesConfig()
    training: TrainingConfig = TrainingConfig()
    data: DataConfig | None = Field(None, description="read a registered dataset (default: the workload's own data)")

    @model_validator(mode="before")
    @classmethod
    def _script_needs_no_name(cls, data: object) -> object:
        """``{"kind": "script", ...}`` is enough: the union is told apart by ``name``."""
        w = data.get("workload") if isinstance(data, dict) else None
        if isinstance(data, dict) and isinstance(w, dict) and w.get("kind") == "script" and "name" not in w:
            data = {**data, "workload": {**w, "name": "script"}}
        return data

    @property
    def default_name(self) -> str:
        """The name a run gets when its spec has none (the api fills it in at submit)."""
        if isinstance(self.workload, ScriptConfig):
            return self.workload.entry
        return f"{self.workload.name}-{self.strategy.kind}"

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.procs_per_node

    @model_validator(mode="after")
    def _batch_splits_across_ranks(self) -> RunSpec:
        if self.data is not None and isinstance(self.workload, FailConfig):
            raise ValueError(
                f"data.dataset ({self.data.dataset!r}) does not apply to workload.name 'fail': it reads the mlp or "
                "charlm workload, or a script"
            )
        if isinstance(self.workload, ScriptConfig):
            if not isinstance(self.strategy, DdpConfig) or self.strategy.comm_hook != "allreduce":
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
        if isinstance(self.strategy, AsyncConfig):  # rank 0 serves the parameters: the others split the batch
            if self.world_size >= 2 and self.training.batch_size % (self.world_size - 1):
                raise ValueError(
                    f"training.batch_size ({self.training.batch_size}) must be divisible by the workers, "
                    f"nodes × procs_per_node − 1 ({self.world_size - 1}): rank 0 is the parameter server"
                )
        elif self.training.batch_size % self.world_size:
            raise ValueError(
                f"training.batch_size ({self.training.batch_size}) must be divisible by "
                f"nodes × procs_per_node ({self.world_size})"
            )
        if (
            isinstance(self.workload, MlpConfig)
            and self.data is None
            and self.workload.params.samples < self.training.batch_size
        ):
            raise ValueError(
                f"workload.params.samples ({self.workload.params.samples}) must be at least "
                f"training.batch_size ({self.training.batch_size})"
            )
        if (activations := self._activations()) > MAX_ACTIVATIONS:
            raise ValueError(
                f"training.batch_size ({self.training.batch_size}) is too large for this model: one step keeps about "
                f"{activations:,} activations for backward, more than {MAX_ACTIVATIONS:,} (2 GiB of fp32)"
            )
        self._strategy_fits()
        if self.training.checkpoint_every and not isinstance(self.strategy, DdpConfig | FsdpConfig | AsyncConfig):
            raise ValueError(
                f"training.checkpoint_every ({self.training.checkpoint_every}) is available for the ddp, fsdp and "
                f"async strategies, not {self.strategy.kind!r} yet"
            )
        if self.training.checkpoint_on_cancel and not isinstance(self.strategy, DdpConfig | FsdpConfig):
            raise ValueError(
                f"training.checkpoint_on_cancel (true) is available for the ddp and fsdp strategies, not "
                f"{self.strategy.kind!r} yet"
            )
        return self

    def _activations(self) -> int:
        """A rough count of the values one step keeps for backward (on the global batch, so it
        is an upper bound for every rank): enough to refuse a spec that cannot fit."""
        b, w = self.training.batch_size, self.workload
        if isinstance(w, MlpConfig):
            p = w.params
            return b * (p.input_dim + p.layers * p.hidden + p.classes)
        if isinstance(w, CharLMConfig):
            p2 = (
                w.params
            )  # per layer: ~16 × d_model per token (qkv, attention out, feed-forward, norms), and the scores
            return b * p2.seq_len * p2.n_layers * (16 * p2.d_model + p2.n_heads * p2.seq_len)
        return 0

    def _strategy_fits(self) -> None:
        """Refuse, quoting the values, a strategy that cannot work for this workload and world."""
        s, world = self.strategy, self.world_size
        if isinstance(s, FsdpConfig | ZeroConfig | LocalSgdConfig | PipelineConfig | TpConfig) and world < 2:
            raise ValueError(
                f"strategy.kind '{s.kind}' shards or averages across ranks: it needs nodes × procs_per_node "
                f"({world}) of at least 2"
            )
        if isinstance(s, FsdpTpConfig):
            if s.tp_degree < 2:
                raise ValueError(
                    f"strategy.tp_degree ({s.tp_degree}) must be at least 2 (without tensor parallelism: kind 'fsdp')"
                )
            if world % s.tp_degree or world // s.tp_degree < 2:
                raise ValueError(
                    f"strategy.tp_degree ({s.tp_degree}) must divide nodes × procs_per_node ({world}) into at least "
                    "2 groups (one group: kind 'tp')"
                )
        if isinstance(s, AsyncConfig):
            self._async_fits(s, world)
        if isinstance(s, TpConfig | FsdpTpConfig):
            self._tensor_parallel_fits(world if isinstance(s, TpConfig) else s.tp_degree, s.sequence_parallel)
        if isinstance(s, PipelineConfig):
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

    def _async_fits(self, s: AsyncConfig, world: int) -> None:
        workers = world - 1
        if workers < 1:
            raise ValueError(
                f"strategy.kind 'async' needs nodes × procs_per_node ({world}) of at least 2: rank 0 is the "
                "parameter server, the others are its workers"
            )
        if 0 < s.max_staleness < workers - 1:
            # workers that start (or resume) together all compute on the same version, and each applied
            # gradient is a version: the last of them is applied workers − 1 versions late
            raise ValueError(
                f"strategy.max_staleness ({s.max_staleness}) must be 0 (synchronous) or at least the workers − 1 "
                f"({workers - 1}): the workers start on the same version, so the last of their first gradients "
                f"is applied {workers - 1} versions late"
            )
        if self.resources.device == "cuda":
            raise ValueError(
                "strategy.kind 'async' runs on resources.device 'cpu' only: its pushes and pulls are Gloo "
                "send/recv of CPU tensors"
            )

    def _tensor_parallel_fits(self, degree: int, sequence_parallel: bool) -> None:
        """The model's split dimensions must divide by the TP degree: the mlp's hidden width (its
        Linears alternate column- and row-wise), charlm's heads (each rank attends with whole heads;
        d_model and the feed-forward width follow) and, sequence-parallel, its sequence."""
        w = self.workload
        if isinstance(self.strategy, FsdpTpConfig):
            where = f"strategy.tp_degree ({degree})"
        else:
            where = f"the TP degree, nodes × procs_per_node ({degree})"
        if isinstance(w, MlpConfig | FailConfig):
            hidden = w.params.hidden if isinstance(w, MlpConfig) else FAIL_MLP.hidden
            if hidden % degree:
                raise ValueError(f"workload.params.hidden ({hidden}) must be divisible by {where}")
        elif isinstance(w, CharLMConfig):
            if w.params.n_heads % degree:
                raise ValueError(f"workload.params.n_heads ({w.params.n_heads}) must be divisible by {where}")
            if sequence_parallel and w.params.seq_len % degree:
                raise ValueError(
                    f"workload.params.seq_len ({w.params.seq_len}) must be divisible by {where} with "
                    "strategy.sequence_parallel (or set it to false)"
                )


def pipeline_blocks(workload: MlpConfig | CharLMConfig | FailConfig | ScriptConfig) -> int:
    """How many pipeline stages a built-in model splits into at most (whole layers per stage)."""
    if isinstance(workload, MlpConfig):
        return workload.params.layers + 1  # each hidden Linear+ReLU, then the output Linear
    if isinstance(workload, CharLMConfig):
        return workload.params.n_layers  # the first stage also embeds; the last also norms and decodes
    return FAIL_MLP.layers + 1  # fail: its small mlp
