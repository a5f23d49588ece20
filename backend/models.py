"""The database: the source of truth for runs, attempts, nodes, allocations and metrics."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from torchyard.spec import RunSpec


def utcnow() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """Timestamps in UTC. SQLite hands them back without a zone; they get it again here, so the
    api always sends RFC 3339 times with an offset."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UtcDateTime(), dict[str, Any]: JSON}


# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets a real bigint.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Token(Base):
    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(20))  # viewer | member | admin
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class BrowserSession(Base):
    """A browser's login: the cookie holds a random id, the database only its SHA-256, so a
    leaked database row cannot be replayed. Ends at logout, at expiry, or when its token is
    revoked."""

    __tablename__ = "sessions"
    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("tokens.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)
    ended_at: Mapped[datetime | None]
    token: Mapped[Token] = relationship()


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    status: Mapped[str] = mapped_column(String(20), index=True)
    status_reason: Mapped[str] = mapped_column(Text, default="")
    spec: Mapped[dict[str, Any]]
    priority: Mapped[int] = mapped_column(default=0)
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("tokens.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    last_step: Mapped[int] = mapped_column(default=0)
    last_step_at: Mapped[datetime | None]  # when last_step last grew: a stalled run is found by it
    # Said at submit, kept for good: e.g. no node can hold the run yet (TORCHYARD_ALLOW_WAITING_FOR_NODES).
    warnings: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    attempts: Mapped[list[Attempt]] = relationship(back_populates="run", order_by="Attempt.number")

    @property
    def run_spec(self) -> RunSpec:
        """The stored spec read through the typed model: the one way the server reads it (its
        defaults, e.g. max_attempts 3, are the spec's, not a reader's guess)."""
        return RunSpec.model_validate(self.spec)


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("run_id", "number"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    number: Mapped[int]
    status: Mapped[str] = mapped_column(String(20))  # scheduled | running | succeeded | failed | cancelled
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    returncode: Mapped[int | None]
    # The first step it logged: where a resumed attempt took over (the boundary the charts draw).
    first_step: Mapped[int | None] = mapped_column(BigInteger)
    # How it ran, in rank 0's word (torchyard/facts.py RunFacts as JSON): world, cores, calibration,
    # collectives per step; what the scaling advisor projects from. NULL until rank 0 tells it.
    facts: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # A Slurm pool's attempt: its job's id ("" from its creation until sbatch answers; NULL on our
    # own workers). Slurm gang-schedules it, so it has no allocations; one job may carry several
    # attempts (Slurm requeued it after a node failure: the attempt's number is the first one's +
    # the job's restart count).
    slurm_job_id: Mapped[str | None] = mapped_column(String(32))
    run: Mapped[Run] = relationship(back_populates="attempts")
    allocations: Mapped[list[Allocation]] = relationship(back_populates="attempt")


class Node(Base):
    __tablename__ = "nodes"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    host: Mapped[str] = mapped_column(String(200))
    slots: Mapped[int]
    devices: Mapped[str] = mapped_column(String(200), default="cpu")
    # Its GPUs as its heartbeat lists them: [{"index": 0, "name": "NVIDIA H200", "memory_bytes": ...}]
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list, server_default="[]")
    status: Mapped[str] = mapped_column(String(20), default="alive")  # alive | lost
    # How its worker caps a run's processes and memory, or why it cannot (workers/caps.py support())
    caps: Mapped[str] = mapped_column(String(300), default="", server_default="")
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)


class Allocation(Base):
    """A share's hold on its node: the CPU slots (a CPU run) or the GPUs (a CUDA run: one process
    per GPU, no slots) one node gives an attempt (a gang of N nodes is N rows made together), held
    until the share's exit is known."""

    __tablename__ = "allocations"
    id: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    node_rank: Mapped[int]
    slots: Mapped[int]
    gpus: Mapped[list[int]] = mapped_column(JSON, default=list, server_default="[]")  # GPU indices, its alone
    # How this node's share ended (its worker's report): the attempt succeeds only when every
    # node's share did; the first share to fail ends the attempt on every node.
    started_at: Mapped[datetime | None]  # its worker reported the share started
    exit_status: Mapped[str | None] = mapped_column(String(20))
    ended_at: Mapped[datetime | None]
    attempt: Mapped[Attempt] = relationship(back_populates="allocations")
    node: Mapped[Node] = relationship()


class RunEvent(Base):
    __tablename__ = "run_events"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    from_status: Mapped[str | None] = mapped_column(String(20))
    to_status: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str] = mapped_column(Text, default="")
    # An alert (backend/alerts.py: a slowdown, a rise of the comm fraction), its state unchanged; NULL: a transition.
    alert: Mapped[str | None] = mapped_column(String(20))


class RunAlert(Base):
    """An alert that holds on a run (``backend/alerts.py``) from its event until the run recovers or
    ends: its key lets one ingest of several raise it once; ``/metrics`` reads them."""

    __tablename__ = "run_alerts"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(20), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger)  # where it was raised
    raised_at: Mapped[datetime] = mapped_column(default=utcnow)


class Metric(Base):
    """One scalar of one rank at one step. The unique key makes ingest idempotent."""

    __tablename__ = "metrics"
    # One index serves both jobs: uniqueness (ingest idempotence) and reading a key's steps in
    # order, or a window of them, for every rank at once.
    # A second one reads back the entries a trimmed stream no longer holds (backend/replay.py).
    __table_args__ = (
        UniqueConstraint("run_id", "key", "step", "rank", "attempt", name="uq_metric_point"),
        Index("ix_metrics_entry_pos", "run_id", "entry_pos"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    rank: Mapped[int]
    step: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[str] = mapped_column(String(200))
    value: Mapped[float | None] = mapped_column(Float)  # NULL: the rank logged NaN
    ts: Mapped[float] = mapped_column(Float)  # unix seconds when the rank logged it
    entry_pos: Mapped[int | None] = mapped_column(BigInteger)  # its stream entry (streams.entry_position)


class MetricRollup(Base):
    """One rank's key over a block of 2**level steps: the extremes (with their steps and times),
    sum and count. Ingest keeps them from the rows it newly inserts (so a redelivered batch adds
    nothing); a chart of a million steps reads a few thousand of these instead of every row."""

    __tablename__ = "metric_rollups"
    __table_args__ = (
        UniqueConstraint("run_id", "key", "level", "bucket", "rank", "attempt", name="uq_metric_rollup_attempt"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(200))
    level: Mapped[int]  # the block is 2**level steps wide
    bucket: Mapped[int] = mapped_column(BigInteger)  # step >> level
    rank: Mapped[int]
    attempt: Mapped[int] = mapped_column(server_default="1")  # a resumed attempt's replayed steps apart
    min_step: Mapped[int] = mapped_column(BigInteger)
    min_value: Mapped[float] = mapped_column(Float)
    min_ts: Mapped[float] = mapped_column(Float)
    max_step: Mapped[int] = mapped_column(BigInteger)
    max_value: Mapped[float] = mapped_column(Float)
    max_ts: Mapped[float] = mapped_column(Float)
    sum: Mapped[float] = mapped_column(Float)
    count: Mapped[int] = mapped_column(BigInteger)


class StepProfile(Base):
    """One rank's sampled step (torch.profiler): its compact timeline, JSON as the rank sent it."""

    __tablename__ = "step_profiles"
    __table_args__ = (UniqueConstraint("run_id", "step", "rank", "attempt", name="uq_step_profile"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    rank: Mapped[int]
    step: Mapped[int] = mapped_column(BigInteger)
    timeline: Mapped[str] = mapped_column(Text)
    entry_pos: Mapped[int | None] = mapped_column(BigInteger)  # its stream entry (streams.entry_position)


class LogLine(Base):
    __tablename__ = "log_lines"
    __table_args__ = (
        UniqueConstraint("run_id", "entry_id", "seq", name="uq_log_line"),
        Index("ix_log_lines_entry_pos", "run_id", "entry_pos"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    entry_id: Mapped[str] = mapped_column(String(40))  # the Redis stream id it came in
    seq: Mapped[int]  # line number inside that entry
    attempt: Mapped[int]
    rank: Mapped[int]  # -1: the launcher / elastic agent
    ts: Mapped[float] = mapped_column(Float)
    text: Mapped[str] = mapped_column(Text)
    # its stream entry (streams.entry_position); NULL for the bounds' own lines, never streamed
    entry_pos: Mapped[int | None] = mapped_column(BigInteger)


class StreamEntry(Base):
    """A platform-stream entry no other table holds as the live stream carried it (a worker's
    report, a state change), kept so a live view resumed behind the trimmed stream can replay it."""

    __tablename__ = "stream_entries"
    __table_args__ = (UniqueConstraint("run_id", "entry_pos", name="uq_stream_entry"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    entry_pos: Mapped[int] = mapped_column(BigInteger)  # streams.entry_position
    type: Mapped[str] = mapped_column(String(20))
    data: Mapped[str] = mapped_column(Text)  # the entry's JSON


class RunMetricKey(Base):
    """A metric key a run has logged: what its charts are (``/metrics/keys``), and what ingest
    counts against TORCHYARD_MAX_METRIC_KEYS."""

    __tablename__ = "run_metric_keys"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)


class RunCounter(Base):
    """Ingest's running totals against a run's bounds: ``log_bytes`` stored, and every line or
    point it truncated or dropped (by ``backend.limits.Drop``), so no bound is ever silent."""

    __tablename__ = "run_counters"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


class Diagnosis(Base):
    """A request to find out why a run's attempt is stuck (a user's "diagnose", or the watchdog's
    before it ends a stalled attempt), with its ranks' hang dumps as each node's worker answers
    (``DiagnosisAnswer``). What the dumps mean is computed when read (``backend/diagnosis.py``)."""

    __tablename__ = "diagnoses"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int]
    request: Mapped[str] = mapped_column(String(64), unique=True)  # the id the ranks answer
    trigger: Mapped[str] = mapped_column(String(20))  # user | stall
    requested_by: Mapped[str] = mapped_column(String(200), default="")
    requested_at: Mapped[datetime] = mapped_column(default=utcnow)
    nodes: Mapped[int]  # answers that make it whole: one per node of the attempt
    world: Mapped[int]
    answers: Mapped[list[DiagnosisAnswer]] = relationship(
        back_populates="diagnosis", order_by="DiagnosisAnswer.id", cascade="all, delete-orphan"
    )


class DiagnosisAnswer(Base):
    """One node's answer: its ranks' dumps (JSON as the worker sent them) and why any are missing."""

    __tablename__ = "diagnosis_answers"
    __table_args__ = (UniqueConstraint("diagnosis_id", "node_id", name="uq_diagnosis_answer"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    diagnosis_id: Mapped[int] = mapped_column(ForeignKey("diagnoses.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str] = mapped_column(String(200))
    received_at: Mapped[datetime] = mapped_column(default=utcnow)
    dumps: Mapped[str] = mapped_column(Text)  # a JSON list of dumps
    missing: Mapped[str] = mapped_column(Text, default="{}")  # a JSON object: local rank → why
    diagnosis: Mapped[Diagnosis] = relationship(back_populates="answers")


class Dataset(Base):
    """A registered dataset: its shards live in the dataset store (``torchyard/stores.py``: a folder
    or an object store; ``torchyard/datasets.py`` has the format). ``uploading`` while its shards arrive; ``ready`` once complete (a manifest written
    for the ranks): only then may a run read it."""

    __tablename__ = "datasets"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    status: Mapped[str] = mapped_column(String(20))  # uploading | ready
    samples: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    digest: Mapped[str] = mapped_column(String(64), default="")  # sha256 over the shards' sha256s, once ready
    # field -> {"samples", "bytes", "npy": {"dtype", "shape"} | None}, over every shard, once ready
    schema: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("tokens.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    completed_at: Mapped[datetime | None]
    shards: Mapped[list[DatasetShard]] = relationship(
        back_populates="dataset", order_by="DatasetShard.index", cascade="all, delete-orphan"
    )


class DatasetShard(Base):
    """One uploaded shard, as the api checked and indexed it."""

    __tablename__ = "dataset_shards"
    __table_args__ = (UniqueConstraint("dataset_id", "index", name="uq_dataset_shard"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"), index=True)
    index: Mapped[int]
    samples: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    index_sha256: Mapped[str] = mapped_column(String(64))
    fields: Mapped[list[str]] = mapped_column(JSON)  # the field numbers of its index records
    schema: Mapped[dict[str, Any]] = mapped_column(JSON)  # as Dataset.schema, over this shard
    dataset: Mapped[Dataset] = relationship(back_populates="shards")


class Sweep(Base):
    """A hyperparameter sweep (``backend/sweeper.py`` runs it): ``spec`` is the SweepSpec as
    submitted; its Optuna study lives in ``sweep_journal``, its trials' runs in ``sweep_trials``."""

    __tablename__ = "sweeps"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), index=True)  # running | succeeded | failed | cancelled
    status_reason: Mapped[str] = mapped_column(Text, default="")
    spec: Mapped[dict[str, Any]]
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("tokens.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    trials: Mapped[list[SweepTrial]] = relationship(back_populates="sweep", order_by="SweepTrial.number")


class SweepTrial(Base):
    """One trial: the Optuna trial of the same number, and the run that trains it (none when its
    parameters made an invalid spec). Made in the transaction that asked Optuna for it, so a
    trial number is never given twice, even across a restart."""

    __tablename__ = "sweep_trials"
    __table_args__ = (UniqueConstraint("sweep_id", "number", name="uq_sweep_trial"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    number: Mapped[int]
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), unique=True)
    params: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(20))  # running | complete | pruned | failed | cancelled
    value: Mapped[float | None] = mapped_column(Float)
    reported_step: Mapped[int] = mapped_column(BigInteger, default=0)  # the last step told to Optuna
    pruned_at: Mapped[int | None] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    sweep: Mapped[Sweep] = relationship(back_populates="trials")
    run: Mapped[Run | None] = relationship()


class SweepJournalEntry(Base):
    """One entry of a sweep's Optuna journal (``backend/sweep_study.py``): the study is these
    entries replayed in ``seq`` order."""

    __tablename__ = "sweep_journal"
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    entry: Mapped[str] = mapped_column(Text)  # the log's JSON
