"""What the api returns: the response models (the run spec itself lives in torchyard.spec)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _FromRow(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class AttemptOut(BaseModel):
    number: int
    status: str
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    first_step: int | None  # where it took over: a resumed attempt replays from its checkpoint's step
    node_ids: list[str]  # by node rank: the first hosts the rendezvous


class RunOut(BaseModel):
    id: int
    name: str
    status: str
    status_reason: str
    spec: dict[str, Any]
    priority: int
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    last_step: int
    attempt_count: int
    node_ids: list[str]  # the latest attempt's, by node rank
    attempts: list[AttemptOut]
    # Filled in the runs list only (one query for the page): at the run's last step.
    samples_per_s: float | None = None  # all ranks together
    comm_fraction: float | None = None  # mean over ranks; None until the run reports it


class RunPage(BaseModel):
    items: list[RunOut]
    total: int
    limit: int
    offset: int


class EventOut(_FromRow):
    id: int
    at: datetime
    from_status: str | None
    to_status: str
    reason: str


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
    label: str  # "thread 1", "stream 0:7"
    kind: Literal["compute", "comm"]
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


class NodeOut(BaseModel):
    id: str
    host: str
    slots: int
    free_slots: int
    devices: list[str]
    status: str
    last_heartbeat: datetime
    running_runs: list[int]


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


class Problem(BaseModel):
    detail: Any


class BundleOut(BaseModel):
    id: str  # the archive's sha256
    size: int  # bytes
    format: str  # zip | tar.gz
    files: list[str]


class CheckpointOut(BaseModel):
    step: int
    size_bytes: int  # the files' bytes; the tar download is slightly larger (headers)
    files: int
    created_at: datetime  # when it was completed
