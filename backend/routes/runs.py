"""/api/v1/runs: submit, list, read, cancel, metrics, sampled-step timelines, logs, events and the live
stream."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Path, Query, Request, status
from fastapi.responses import StreamingResponse
from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from backend import bundles, lifecycle, metrics, runs
from backend.db import get_sessionmaker
from backend.deps import DB_INT_MAX, Member, RedisDep, RunDep, RunId, SessionDep, Viewer, get_async_redis
from backend.models import Metric, Run
from backend.schemas import (
    AttemptOut,
    EventOut,
    LogLineOut,
    MetricSeries,
    ProfiledStepOut,
    RunOut,
    RunPage,
    StepTimelines,
)
from torchyard import streams
from torchyard.settings import get_settings
from torchyard.spec import RunSpec, ScriptWorkload

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])


def run_out(run: Run) -> RunOut:
    attempts = [
        AttemptOut(
            number=a.number,
            status=a.status,
            created_at=a.created_at,
            started_at=a.started_at,
            ended_at=a.ended_at,
            first_step=a.first_step,
            node_ids=[alloc.node_id for alloc in sorted(a.allocations, key=lambda alloc: alloc.node_rank)],
        )
        for a in run.attempts
    ]
    return RunOut(
        id=run.id,
        name=run.name,
        status=run.status,
        status_reason=run.status_reason,
        spec=run.spec,
        priority=run.priority,
        created_at=run.created_at,
        started_at=run.started_at,
        ended_at=run.ended_at,
        last_step=run.last_step,
        attempt_count=len(run.attempts),
        node_ids=attempts[-1].node_ids if attempts else [],
        attempts=attempts,
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunOut)
def submit_run(spec: RunSpec, session: SessionDep, redis: RedisDep, token: Member) -> RunOut:
    if isinstance(spec.workload, ScriptWorkload):
        bundles.check_script_or_422(get_settings(), spec.workload)
    run = runs.create_run(session, spec, token, get_settings().max_runs_in_flight)
    session.commit()  # durable before the scheduler hears of it
    redis.rpush(streams.SCHEDULER_WAKE, run.id)
    return run_out(run)


@router.get("", response_model=RunPage)
def list_runs(
    session: SessionDep,
    _viewer: Viewer,
    status_filter: Annotated[str | None, Query(alias="status", description="comma list of states")] = None,
    name: Annotated[str | None, Query(description="substring of the run name")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=DB_INT_MAX)] = 0,
) -> RunPage:
    if status_filter:
        unknown = set(status_filter.split(",")) - set(lifecycle.TRANSITIONS)
        if unknown:
            raise runs.InvalidRequest(
                ["query", "status"],
                f"status ({','.join(sorted(unknown))}) is not a run state: {', '.join(lifecycle.TRANSITIONS)}",
                status_filter,
            )
    items, total = runs.list_runs(session, status_filter, name, limit, offset)
    out = [run_out(r) for r in items]
    figures = _last_step_figures(session, items)
    for row in out:
        row.samples_per_s, row.comm_fraction = figures.get(row.id, (None, None))
    return RunPage(items=out, total=total, limit=limit, offset=offset)


def _last_step_figures(session: Session, items: Sequence[Run]) -> dict[int, tuple[float | None, float | None]]:
    """Throughput (sum over ranks) and comm fraction (mean over ranks) at each run's last step:
    one indexed query for the whole page, on (run_id, key, step)."""
    pairs = [(r.id, r.last_step) for r in items if r.last_step > 0]
    if not pairs:
        return {}
    rows = session.execute(
        select(Metric.run_id, Metric.key, func.sum(Metric.value), func.avg(Metric.value))
        .where(
            Metric.key.in_(("samples_per_s", "comm_fraction")),
            tuple_(Metric.run_id, Metric.step).in_(pairs),
        )
        .group_by(Metric.run_id, Metric.key)
    ).all()
    figures: dict[int, tuple[float | None, float | None]] = {}
    for run_id, key, total, mean in rows:
        throughput, fraction = figures.get(run_id, (None, None))
        if key == "samples_per_s":
            throughput = total
        else:
            fraction = mean
        figures[run_id] = (throughput, fraction)
    return figures


@router.get("/{run_id}", response_model=RunOut)
def get_run(run: RunDep) -> RunOut:
    return run_out(run)


@router.get("/{run_id}/events", response_model=list[EventOut])
def get_events(run: RunDep, session: SessionDep) -> list[Any]:
    return list(runs.list_events(session, run.id))


@router.post("/{run_id}/cancel", response_model=RunOut)
def cancel_run(run_id: RunId, session: SessionDep, redis: RedisDep, token: Member) -> RunOut:
    run = runs.get_run(session, run_id)
    if token.role != "admin" and run.owner_id != token.id:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"run {run_id} is not yours; only its owner or an admin may cancel it"
        )
    runs.request_cancel(session, run, f"cancelled by {token.name}")
    session.commit()
    # The worker running it polls this key; it outlives any run (a day) and costs nothing.
    redis.set(streams.cancel_key(run.id), "1", ex=86400)
    return run_out(run)


@router.get("/{run_id}/metrics/keys", response_model=list[str])
def metric_keys(run: RunDep, session: SessionDep) -> list[str]:
    return metrics.keys(session, run.id)


@router.get("/{run_id}/metrics", responses={200: {"model": MetricSeries}})
def get_metrics(
    run: RunDep,
    session: SessionDep,
    key: Annotated[str, Query(min_length=1, description="metric name, e.g. loss")],
    max_points: Annotated[int | None, Query(ge=2, le=100_000, description="min/max downsampling target")] = None,
    step_min: Annotated[int | None, Query(ge=0, le=DB_INT_MAX)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=DB_INT_MAX)] = None,
) -> dict[str, Any]:
    return metrics.series(session, run.id, key, max_points, step_min, step_max, run.last_step)


@router.get("/{run_id}/profiles", response_model=list[ProfiledStepOut])
def list_profiles(run: RunDep, session: SessionDep) -> list[dict[str, Any]]:
    """The steps sampled with torch.profiler (training.profile_every), newest first."""
    return runs.profiled_steps(session, run.id)


@router.get("/{run_id}/profiles/{step}", response_model=StepTimelines)
def get_profile(
    run: RunDep, session: SessionDep, step: Annotated[int, Path(ge=0, le=DB_INT_MAX, description="a sampled step")]
) -> dict[str, Any]:
    """Every rank's timeline of one sampled step: compute and communication spans, in µs."""
    return runs.step_timelines(session, run.id, step)


@router.get("/{run_id}/logs", response_model=list[LogLineOut])
def get_logs(
    run: RunDep,
    session: SessionDep,
    rank: Annotated[int | None, Query(ge=-1, description="-1: the launcher and elastic agent")] = None,
    after: Annotated[int, Query(ge=0, le=DB_INT_MAX, description="return lines with id greater than this")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[Any]:
    return list(runs.list_logs(session, run.id, rank, after, limit))


@router.get("/{run_id}/stream", response_class=StreamingResponse)
async def stream_run(
    run: RunDep,
    request: Request,
    viewer: Viewer,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    since: Annotated[str | None, Query(description="stream id to resume after; '$' for new events only")] = None,
) -> StreamingResponse:
    """Server-Sent Events: every metric batch, log batch and state change of the run, each with
    its Redis stream id as the event id, so a reconnect with Last-Event-ID misses nothing and
    repeats nothing. Ends after the run's terminal state has been sent."""
    start = last_event_id or since or "0-0"
    if start != "$" and not _valid_stream_id(start):
        raise runs.InvalidRequest(
            ["header", "Last-Event-ID"],
            f"Last-Event-ID/since ({start!r}) is not a stream id like 1700000000000-0",
            start,
        )
    limit = get_settings().max_streams_per_token
    if _open_streams[viewer.id] >= limit:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            f"token {viewer.name!r} already has {limit} live streams open here "
            "(TORCHYARD_MAX_STREAMS_PER_TOKEN): close one first",
        )
    _open_streams[viewer.id] += 1
    finished = run.status in lifecycle.TERMINAL
    return StreamingResponse(
        _sse(request, run.id, start, finished, viewer.id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _valid_stream_id(value: str) -> bool:
    ms, _, seq = value.partition("-")
    return ms.isdigit() and (seq == "" or seq.isdigit())


# Live streams each token holds open in this api process (each holds a Redis connection).
_open_streams: Counter[int] = Counter()


async def _sse(request: Request, run_id: int, start: str, finished: bool, token_id: int) -> AsyncIterator[bytes]:
    client = get_async_redis()
    key = streams.run_stream(run_id)
    last = start
    if last == "$":
        newest: Any = await client.xrevrange(key, count=1)
        last = newest[0][0].decode() if newest else "0-0"
    try:
        yield b"retry: 1000\n\n"
        while not await request.is_disconnected():
            batch: Any = await client.xread({key: last}, count=500, block=None if finished else 5000)
            if not batch:
                if finished:
                    return  # everything the stream holds has been sent
                yield b": keep-alive\n\n"
                # The database is the truth: a state change whose publish was lost still ends us.
                finished = await run_in_threadpool(_is_terminal, run_id)
                continue
            for entry_id, fields in batch[0][1]:
                last = entry_id.decode()
                entry_type, data = streams.decode(fields)
                yield f"id: {last}\nevent: {entry_type}\ndata: {_browser_json(data)}\n\n".encode()
                if entry_type == streams.STATE and data.get("status") in lifecycle.TERMINAL:
                    finished = True
    finally:
        await client.aclose()
        _open_streams[token_id] -= 1


def _browser_json(data: Any) -> str:
    """JSON a browser can parse: NaN and infinities (a diverged loss) become null."""

    def clean(value: Any) -> Any:
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    try:
        return json.dumps(data, allow_nan=False)
    except ValueError:
        return json.dumps(clean(data))


def _is_terminal(run_id: int) -> bool:
    with get_sessionmaker()() as session:
        return runs.get_run(session, run_id).status in lifecycle.TERMINAL
