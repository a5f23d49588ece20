"""The run spec: what a user submits. Validated at submit (a bad spec is a 422 that names the
field and the value) and handed unchanged to the ranks, which read it back with the same models.

Every number is finite and bounded (the api runs this on strangers' input; a rank allocates what
it says): the bounds below are the one place they are set, and README's "Limits" quotes them."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from torchyard.datasets import NAME as DATASET_NAME

# Step-like counts (steps, every-N-steps, warm-ups). Past this a run would outlive any machine.
MAX_STEPS = 100_000_000
# Built-in workloads' memory, in fp32 elements, estimated from the params before a rank allocates
# it; together they keep a rank within a few GiB (host OOM otherwise takes the node down):
MAX_PARAMETERS = 2**27  # model weights: 512 MiB, about 2 GiB with gradients and optimizer state
MAX_DATA_ELEMENTS = 2**28  # the mlp's synthetic data set: 1 GiB
MAX_ACTIVATIONS = 2**29  # one step's activations kept for backward (global batch, rough): 2 GiB
MAX_SECONDS = 30 * 86_400  # stall_timeout_s, max_duration_s: 30 days


class _Strict(BaseModel):
    # allow_inf_nan=False: NaN/Infinity (Python's json reads them, and 1e400 as inf) are a 422.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class MlpParams(_Strict):
    input_dim: int = Field(32, ge=1, le=65536)
    hidden: int = Field(128, ge=1, le=65536)
    layers: int = Field(3, ge=1, le=64, description="hidden layers")
    classes: int = Field(10, ge=2, le=65536)
    samples: int = Field(
        8192,
        ge=1,
        le=10_000_000,
        description=f"synthetic data set size; samples × input_dim ≤ {MAX_DATA_ELEMENTS:,} (1 GiB of fp32)",
    )

    @model_validator(mode="after")
    def _fits_in_memory(self) -> MlpParams:
        if self.samples * self.input_dim > MAX_DATA_ELEMENTS:
            raise ValueError(
                f"workload.params.samples × input_dim ({self.samples} × {self.input_dim}) must be at most "
                f"{MAX_DATA_ELEMENTS:,} (a 1 GiB data set on every rank)"
            )
        if self.parameters > MAX_PARAMETERS:
            raise ValueError(
                f"workload.params: the model has {self.parameters:,} parameters (input_dim × hidden + "
                f"(layers − 1) × hidden² + hidden × classes), more than {MAX_PARAMETERS:,}"
            )
        return self

    @property
    def parameters(self) -> int:
        return self.input_dim * self.hidden + (self.layers - 1) * self.hidden**2 + self.hidden * self.classes


class CharLMParams(_Strict):
    d_model: int = Field(64, ge=8, le=4096)
    n_layers: int = Field(2, ge=1, le=48)
    n_heads: int = Field(4, ge=1, le=64)
    seq_len: int = Field(64, ge=8, le=4096)
    corpus_bytes: int = Field(
        2_000_000, ge=10_000, le=2**26, description="bytes of stdlib source to train on (at most 64 MiB)"
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> CharLMParams:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.parameters > MAX_PARAMETERS:
            raise ValueError(
                f"workload.params: the model has about {self.parameters:,} parameters (12 × d_model² × n_layers), "
                f"more than {MAX_PARAMETERS:,}"
            )
        return self

    @property
    def parameters(self) -> int:
        return 12 * self.d_model**2 * self.n_layers


class MlpConfig(_Strict):
    kind: Literal["builtin"] = "builtin"
    name: Literal["mlp"]
    params: MlpParams = MlpParams()


class CharLMConfig(_Strict):
    kind: Literal["builtin"] = "builtin"
    name: Literal["charlm"]
    params: CharLMParams = CharLMParams()


class FailParams(_Strict):
    at_step: int = Field(1, ge=1, le=MAX_STEPS, description="the step at which it fails")
    rank: int | None = Field(None, ge=0, le=2**16, description="only this rank fails (default: every rank)")
    times: int = Field(0, ge=0, le=1000, description="fail only in the first N starts of the ranks (0: every start)")
    hang: bool = Field(False, description="hang (stop stepping) instead of raising")
    hang_in: Literal["python", "data_loading", "skip_collective", "other_collective"] = Field(
        "python",
        description="where a hang happens: waiting in Python at the step; sleeping while loading the step's batch; "
        "past an all_reduce the other ranks wait in (skip_collective) or in a broadcast where they all_reduce "
        "(other_collective): the last two need `rank`",
    )

    slow_s: float = Field(
        0,
        ge=0,
        le=60,
        description="> 0: instead of raising, the rank (or every rank) is this many seconds slower per step from "
        "at_step on, in `slow_in` (a straggler, or a run that slows down)",
    )
    slow_in: Literal["data_loading", "compute", "throttled"] = Field(
        "data_loading",
        description="where a slow step spends its extra time: loading the batch (data_time_s) or between loading "
        "and the backward's collectives (compute_time_s); or `throttled`: the rank may use 5 % of a CPU and is "
        "stopped whenever it is over, as a container at its CPU quota is (any slow_s > 0; how much slower depends "
        "on the step)",
    )

    @model_validator(mode="after")
    def _one_rank_leaves_the_others(self) -> FailParams:
        if self.hang and self.slow_s:
            raise ValueError(
                f"workload.params.hang and workload.params.slow_s ({self.slow_s:g}) exclude each other: a rank "
                "either hangs or runs slowly"
            )
        if self.hang and self.hang_in.endswith("_collective") and self.rank is None:
            raise ValueError(
                f"workload.params.hang_in ({self.hang_in!r}) needs workload.params.rank: the rank that breaks "
                "away from the collective the others make"
            )
        return self


FAIL_MLP = MlpParams(hidden=16, layers=1, samples=1024)  # the fail workload's model and data


class FailConfig(_Strict):
    """Raises (or hangs, or slows down) at the given step: shows how a failing, hung or straggling
    run looks, how torch elastic restarts a crashed rank, how the watchdog finds a stall, how a
    straggler is named and a slowdown raises an alert (and tests them)."""

    kind: Literal["builtin"] = "builtin"
    name: Literal["fail"]
    params: FailParams = FailParams()


BUNDLE_ID = r"^[0-9a-f]{64}$"


class ScriptConfig(_Strict):
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
    def _entry_inside_bundle(self) -> ScriptConfig:
        parts = self.entry.replace("\\", "/").split("/")
        if self.entry.startswith("/") or ".." in parts or not self.entry.endswith(".py"):
            raise ValueError(f"workload.entry ({self.entry!r}) must be a relative path to a .py file inside the bundle")
        return self


WorkloadConfig = Annotated[MlpConfig | CharLMConfig | FailConfig | ScriptConfig, Field(discriminator="name")]


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
