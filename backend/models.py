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
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


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
    attempts: Mapped[list[Attempt]] = relationship(back_populates="run", order_by="Attempt.number")


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
    run: Mapped[Run] = relationship(back_populates="attempts")
    allocations: Mapped[list[Allocation]] = relationship(back_populates="attempt")


class Node(Base):
    __tablename__ = "nodes"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    host: Mapped[str] = mapped_column(String(200))
    slots: Mapped[int]
    devices: Mapped[str] = mapped_column(String(200), default="cpu")
    status: Mapped[str] = mapped_column(String(20), default="alive")  # alive | lost
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)


class Allocation(Base):
    """One node's share of an attempt: gang placement of N nodes is N rows made together."""

    __tablename__ = "allocations"
    id: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    node_rank: Mapped[int]
    slots: Mapped[int]
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


class Metric(Base):
    """One scalar of one rank at one step. The unique key makes ingest idempotent."""

    __tablename__ = "metrics"
    # One index serves both jobs: uniqueness (ingest idempotence) and reading a key's steps in
    # order, or a window of them, for every rank at once.
    __table_args__ = (UniqueConstraint("run_id", "key", "step", "rank", "attempt", name="uq_metric_point"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    rank: Mapped[int]
    step: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[str] = mapped_column(String(200))
    value: Mapped[float | None] = mapped_column(Float)  # NULL: the rank logged NaN
    ts: Mapped[float] = mapped_column(Float)  # unix seconds when the rank logged it


class MetricRollup(Base):
    """One rank's key over a block of 2**level steps: the extremes (with their steps and times),
    sum and count. Ingest keeps them from the rows it newly inserts (so a redelivered batch adds
    nothing); a chart of a million steps reads a few thousand of these instead of every row."""

    __tablename__ = "metric_rollups"
    __table_args__ = (UniqueConstraint("run_id", "key", "level", "bucket", "rank", name="uq_metric_rollup"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(200))
    level: Mapped[int]  # the block is 2**level steps wide
    bucket: Mapped[int] = mapped_column(BigInteger)  # step >> level
    rank: Mapped[int]
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


class LogLine(Base):
    __tablename__ = "log_lines"
    __table_args__ = (UniqueConstraint("run_id", "entry_id", "seq", name="uq_log_line"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    entry_id: Mapped[str] = mapped_column(String(40))  # the Redis stream id it came in
    seq: Mapped[int]  # line number inside that entry
    attempt: Mapped[int]
    rank: Mapped[int]  # -1: the launcher / elastic agent
    ts: Mapped[float] = mapped_column(Float)
    text: Mapped[str] = mapped_column(Text)
