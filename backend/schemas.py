"""What the api returns: the response models (the run spec itself lives in torchyard.spec)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from backend.advisor import ProjectionPoint
from backend.alerts import AlertKind
from backend.sweep_spec import SweepSpec
from torchyard.datasets import NAME as DATASET_NAME
from torchyard.facts import RunFacts
from torchyard.spec import RunSpec
from torchyard.states import AttemptState, NodeState, RunState, SweepState, TrialState


class _FromRow(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class AttemptOut(BaseModel):
    number: int
    status: AttemptState
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    first_step: int | None  # where it took over: a resumed attempt replays from its checkpoint's step
    node_ids: list[str]  # by node rank: the first hosts the rendezvous
    gpus: list[list[int]]  # by node rank: the GPU indices each node's share holds (empty for a CPU run)
    facts: RunFacts | None = None  # how it ran, in rank 0's word (torchyard/facts.py); None until told


class RunSummary(BaseModel):
    """Over the whole run, the newest attempt's value where a step was logged again."""

    mean_samples_per_s: float | None  # global batch / mean step time (a script: its ranks' own, added up)
    mean_comm_fraction: float | None  # mean over ranks and steps
    final_loss: float | None  # across-rank mean at the last step that logged loss
    final_loss_step: int | None
    best_loss: float | None  # lowest across-rank mean of a step (over 20,000 steps: of a 64-step block)
    wall_time_s: float | None  # started → ended (or now)
    mean_comm_bytes: float | None = None  # bytes a rank's collectives moved per step, mean over ranks and steps
    peak_memory_bytes: float | None = None  # the highest of any rank: CUDA's max allocated, else the process's max RSS


class RunOut(BaseModel):
    id: int
    name: str
    status: RunState
    status_reason: str
    spec: RunSpec
    priority: int
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    last_step: int
    attempt_count: int
    node_ids: list[str]  # the latest attempt's, by node rank
    attempts: list[AttemptOut]
    warnings: list[str]  # said at submit, e.g. that no node can hold the run yet
    # At the run's last step (backend/figures.py has the definitions); None until the run reports them.
    samples_per_s: float | None = None  # global batch / the slowest rank's step time
    comm_fraction: float | None = None  # mean over ranks
    summary: RunSummary | None = None  # GET /runs/{id} only (a few reads per run: not for every row of a list)


class SkippedStrategy(BaseModel):
    strategy: str
    reason: str  # why it does not apply to the run's workload, resources or training


class StrategyComparison(BaseModel):
    runs: list[RunOut]  # queued together, one per strategy that applies (the run's own among them)
    skipped: list[SkippedStrategy]


class RunPage(BaseModel):
    items: list[RunOut]
    total: int
    limit: int
    offset: int


class EventOut(_FromRow):
    id: int
    at: datetime
    from_status: RunState | None
    to_status: RunState  # an alert's: the state it happened in (unchanged)
    reason: str
    alert: AlertKind | None = None  # an alert (backend/alerts.py), not a transition


class LogLineOut(_FromRow):
    id: int
    attempt: int
    rank: int
    ts: float
    text: str


class ProfiledStepOut(BaseModel):
    step: int
    attempt: int
    ranks: list[int]


class TimelineLane(BaseModel):
    label: str  # "thread 1", "cuda:0 stream 7"
    kind: Literal["compute", "comm", "copy"]  # copy: host/device memcpy and memset (CUDA), not compute
    spans: list[list[int]]  # [start µs from the step's first span, duration µs, index into names]
    dropped: int  # shorter spans left out (at most 300 kept per lane)


class Timeline(BaseModel):
    step: int
    duration_us: int
    names: list[str]
    lanes: list[TimelineLane]
    figures: dict[str, float]  # prof_comm_time_s, prof_exposed_comm_s, prof_compute_time_s, prof_overlap_fraction


class StepTimelines(BaseModel):
    step: int
    attempt: int
    ranks: dict[str, Timeline]


class GpuOut(BaseModel):
    index: int  # the driver's index: what CUDA_VISIBLE_DEVICES names
    name: str  # the model; "" when the node's inventory was set by TORCHYARD_NODE_GPUS
    memory_bytes: int | None
    run_id: int | None  # the run holding it, None while free


class NodeOut(BaseModel):
    id: str
    host: str
    slots: int  # CPU slots: what CPU runs take (CUDA runs take GPUs instead)
    free_slots: int
    devices: list[str]
    gpus: list[GpuOut]
    free_gpus: int
    status: NodeState
    last_heartbeat: datetime
    running_runs: list[int]
    caps: str  # how its worker caps a run's processes and memory, or why it cannot ("": not said)


class SlurmNodeOut(BaseModel):
    name: str
    partition: str
    state: str  # sinfo's short state: idle, alloc, mix, down, drain, ...
    cpus: str
    gres: str  # generic resources, e.g. gpu:a100:4 ("(null)": none)


class SlurmJobOut(BaseModel):
    run_id: int
    attempt: int
    job_id: str
    status: str  # the run's


class PoolOut(BaseModel):
    """A pool runs go to (TORCHYARD_POOLS): the built-in workers (their nodes: GET /api/v1/nodes) or a
    Slurm cluster, with its partitions and nodes as ``sinfo`` says now, and the runs it holds."""

    name: str
    executor: str  # workers | slurm
    default: bool
    partition: str
    account: str
    partitions: dict[str, int] = {}  # partition -> its node count (slurm)
    default_partition: str = ""
    nodes: list[SlurmNodeOut] = []
    jobs: list[SlurmJobOut] = []
    error: str = ""  # the cluster did not answer: Slurm's own message


class RankSeries(BaseModel):
    step: list[int]
    value: list[float | None]
    ts: list[float]


class AggregateSeries(BaseModel):
    step: list[int]
    mean: list[float | None]
    min: list[float | None]
    max: list[float | None]


class MetricSeries(BaseModel):
    """Documents GET /runs/{id}/metrics (the route returns the dict as is: no validation of
    up to millions of floats on the way out)."""

    run_id: int
    key: str
    ranks: dict[str, RankSeries]
    aggregate: AggregateSeries
    bucket_steps: int  # 1: every step (or min/max of rows); 2**level: min/max per block from rollups
    downsampled: bool  # true when some points were left out (min/max per bucket kept): ask for a narrower range


class Heatmap(BaseModel):
    """Documents GET /runs/{id}/heatmap (returned as is, like the metric series)."""

    run_id: int
    key: str
    step_min: int  # the range asked for
    step_max: int
    ranks: list[int]  # the rows
    steps: list[int]  # each column's first step
    bucket_steps: int  # steps per column (a power of two: blocks aligned as the rollups' are)
    values: list[list[float | None]]  # [row][column]: the rank's mean over the column's steps; null: none logged


class RankTimesOut(BaseModel):
    """One rank's medians over the window (null: not logged)."""

    rank: int
    steps: int
    step_time_s: float | None
    data_time_s: float | None
    compute_time_s: float | None
    exposed_comm_s: float | None
    first_comm_at_s: float | None  # its arrival at the step's first collective, from the step's start


class StragglerOut(BaseModel):
    rank: int
    cause: Literal["data", "compute"]  # data: loading the batch and copying it to the device
    late_s: float  # its arrival at the first collective after the others' (median)
    extra_data_s: float  # its data time over the others'
    extra_compute_s: float
    others_wait_s: float  # the others' exposed comm over its own
    text: str


class StragglersOut(BaseModel):
    run_id: int
    step_min: int  # the window
    step_max: int
    threshold_s: float | None  # late and waited for at least this long (per step) to be named
    headline: str
    stragglers: list[StragglerOut]  # the latest first; none in a balanced run
    ranks: list[RankTimesOut]


class MeasuredOut(BaseModel):
    """What the projection starts from: the run's medians over its steady steps and its rank 0's facts."""

    model_config = ConfigDict(from_attributes=True)
    world: int
    nodes: int
    ranks_per_node: int
    cpu_cores: int
    device: str
    per_rank_batch: int
    steps: int  # the steady steps the medians are over
    step_time_s: float  # the slowest rank's
    data_time_s: float
    compute_time_s: float
    comm_time_s: float
    exposed_comm_s: float
    hidden_comm_s: float
    samples_per_s: float  # the global batch over the step time
    bytes_per_step: dict[str, float]  # collective kind → bytes
    ops_per_step: dict[str, int]  # collective kind → collectives
    calibration: dict[int, float]  # message bytes → all-reduce busbw (GB/s)
    peak_bytes: float
    state_bytes: float  # parameters, gradients and optimizer state per rank


class ProjectionOut(BaseModel):
    """The scaling advisor's answer (backend/advisor.py)."""

    run_id: int
    strategy: str
    measured: MeasuredOut
    latency_s: float  # the fitted link: per ring hop
    busbw_GBps: float | None  # the fitted link's bus bandwidth (null: the calibration showed no limit)
    comm_efficiency: float  # the run's comm speed as a share of the fitted link's
    points: list[ProjectionPoint]
    assumptions: list[str]
    excluded: dict[str, str]  # strategy → why it is not projected


class Problem(BaseModel):
    detail: Any


class BundleOut(BaseModel):
    id: str  # the archive's sha256
    size: int  # bytes
    format: str  # zip | tar.gz
    files: list[str]


class DatasetCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=DATASET_NAME, description="its name: letters, digits, '.', '_' and '-'")


class FieldOut(BaseModel):
    samples: int  # samples that have the field
    bytes: int
    npy: dict[str, Any] | None = None  # {"dtype": "<f4", "shape": [32]} when every .npy of it agrees


class ShardOut(BaseModel):
    index: int
    file: str  # its name in the dataset's folder (what a failure reason names)
    samples: int
    bytes: int
    sha256: str


class DatasetOut(BaseModel):
    name: str
    status: Literal["uploading", "ready"]
    samples: int  # 0 until ready
    bytes: int
    shards: int
    digest: str  # sha256 over the shards' sha256s: the content's identity ("" until ready)
    schema_: dict[str, FieldOut] = Field(alias="schema")  # field -> what its samples hold
    created_at: datetime
    completed_at: datetime | None
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


class DatasetDetail(DatasetOut):
    shard_list: list[ShardOut]


class CheckpointOut(BaseModel):
    step: int
    size_bytes: int  # the files' bytes; the tar download is slightly larger (headers)
    files: int
    created_at: datetime  # when it was completed


class StackFrame(BaseModel):
    file: str
    line: int
    func: str
    code: str  # the source line
    lib: bool  # in the standard library or an installed package, not the run's own code


class DiagnosisFinding(BaseModel):
    kind: Literal[
        "mismatch", "never_entered", "waits_on_silent", "all_entered", "mismatch_done", "no_collective", "silent"
    ]
    text: str
    ranks: list[int]  # the ranks it names: the odd ones out, the ones that never came, the silent
    waiting: list[int]  # the ranks waiting on them
    group: str | None = None  # the process group's name
    seq: int | None = None  # the collective's sequence number in its group
    op: str | None = None


class DiagnosisRank(BaseModel):
    rank: int
    state: Literal["collective", "python", "silent"]  # waits in a collective, runs Python, did not answer
    where: str
    waiting_s: float | None = None  # how long it had waited in its collective when it answered
    frames: list[StackFrame]  # the innermost frames of the run's own code in the stuck thread
    innermost: StackFrame | None  # the very innermost frame, library or not
    recorder: str | None = None  # why its Flight Recorder could not be read


class LastCollective(BaseModel):
    seq: int
    op: str
    sizes: str
    state: Literal["completed", "waiting"]


class GroupRank(BaseModel):
    rank: int
    entered: int | None  # the last sequence number it entered; None: no dump
    completed: int | None
    last: LastCollective | None  # the collective it entered last, if its recorder still holds it


class DiagnosisGroup(BaseModel):
    group: str
    label: str
    ranks: list[GroupRank]


class DiagnosisOut(BaseModel):
    request: str
    attempt: int
    trigger: Literal["user", "stall"]
    requested_by: str
    requested_at: datetime
    status: Literal["pending", "complete", "partial"]  # partial: not every node answered in time
    nodes: int
    nodes_answered: int
    answered_at: datetime | None  # when the last node's answer came
    headline: str
    findings: list[DiagnosisFinding]
    ranks: list[DiagnosisRank]
    groups: list[DiagnosisGroup]
    answered: int  # ranks whose dump came
    world: int


class TrialOut(BaseModel):
    number: int
    run_id: int | None  # None: its parameters made an invalid spec (``reason`` says how)
    params: dict[str, Any]  # spec path → value
    state: TrialState
    value: float | None  # the objective, once complete
    pruned_at: int | None  # the step at which the pruner stopped it
    reported_step: int  # the last step whose objective Optuna was told
    reason: str  # why it was pruned, failed or cancelled
    run_status: RunState | None
    created_at: datetime
    ended_at: datetime | None


class SweepOut(BaseModel):
    id: int
    name: str
    status: SweepState
    status_reason: str
    spec: SweepSpec
    created_at: datetime
    ended_at: datetime | None
    best_trial: int | None  # the number of the complete trial with the best value
    best_value: float | None
    trials: list[TrialOut]


class SweepImportanceOut(BaseModel):
    evaluator: str  # Optuna's evaluator that gave them ("ped-anova": backend/sweep_study.py says why)
    trials: int  # the complete trials they were computed over (fewer than 2: every importance 0)
    importance: dict[str, float]  # spec path → importance (they sum to 1 when computed)


class SweepPage(BaseModel):
    items: list[SweepOut]
    total: int
    limit: int
    offset: int
