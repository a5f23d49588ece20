"""/api/v1/runs: submit, list, read, cancel, metrics, sampled-step timelines, logs, events and the live
stream."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query, Request, Response, status
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from backend import (
    bundles,
    checkpoints,
    comparison,
    datasets,
    errors,
    figures,
    lifecycle,
    live,
    metrics,
    run_signals,
    runs,
)
from backend.db import get_sessionmaker
from backend.deps import (
    DB_INT32_MAX,
    DB_INT_MAX,
    CallerDep,
    Member,
    RedisDep,
    RunDep,
    RunId,
    SessionDep,
    Viewer,
    check_owner,
)
from backend.models import Run, Token
from backend.schemas import (
    AttemptOut,
    EventOut,
    LogLineOut,
    MetricSeries,
    Problem,
    ProfiledStepOut,
    RunOut,
    RunPage,
    RunSummary,
    SkippedStrategy,
    StepTimelines,
    StrategyComparison,
)
from torchyard import streams
from torchyard.settings import get_settings
from torchyard.spec import RunSpec, ScriptConfig
from torchyard.states import TERMINAL
from torchyard.streams import MAX_KEY_CHARS

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
            gpus=[list(alloc.gpus) for alloc in sorted(a.allocations, key=lambda alloc: alloc.node_rank)],
            facts=a.facts,
        )
        for a in run.attempts
    ]
    return RunOut(
        id=run.id,
        name=run.name,
        status=run.status,
        status_reason=run.status_reason,
        spec=run.run_spec,
        priority=run.priority,
        created_at=run.created_at,
        started_at=run.started_at,
        ended_at=run.ended_at,
        last_step=run.last_step,
        attempt_count=len(run.attempts),
        node_ids=attempts[-1].node_ids if attempts else [],
        attempts=attempts,
        warnings=list(run.warnings or []),
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunOut)
def submit_run(spec: RunSpec, session: SessionDep, redis: RedisDep, token: Member) -> RunOut:
    """A run no registered node set can ever hold is a 422 naming the field and the largest node,
    unless TORCHYARD_ALLOW_WAITING_FOR_NODES: then it is accepted with ``warnings`` saying so. With
    no node registered at all it is accepted and waits for one (``warnings`` says so too)."""
    if isinstance(spec.workload, ScriptConfig):
        bundles.check_script_workload(get_settings(), spec.workload)
    datasets.check_run_data(session, spec)
    run = _create(session, spec, token)
    _enqueue(session, redis, [run])
    return run_out(run)


def _create(session: Session, spec: RunSpec, token: Token) -> Run:
    """A queued run of ``spec``, owned by ``token``, under the settings' quota and priority bounds."""
    settings = get_settings()
    checkpoints.check_member_room(session, settings, token)
    return runs.create_run(
        session,
        spec,
        token,
        settings.max_runs_in_flight,
        settings.max_member_priority,
        settings.allow_waiting_for_nodes,
    )


def _enqueue(session: Session, redis: Any, created: list[Run]) -> None:
    """Commits runs just created and tells the scheduler (``backend/run_signals.py``)."""
    run_signals.clear_streams(redis, [run.id for run in created])
    session.commit()  # durable before the scheduler hears of them
    run_signals.wake_scheduler(redis, [run.id for run in created])


@router.post("/{run_id}/strategy-comparison", status_code=status.HTTP_201_CREATED, response_model=StrategyComparison)
def compare_strategies(run_id: RunId, session: SessionDep, redis: RedisDep, token: Member) -> StrategyComparison:
    """The run's workload, data, resources and training once per strategy that applies (its own
    strategy with its options, the others with their defaults), queued together; ``skipped`` says
    why each other strategy does not apply. Read them side by side on the compare page."""
    run = runs.get_run(session, run_id)  # after the role check: a viewer learns nothing of which runs exist
    specs, skipped = comparison.variants(run.run_spec)
    datasets.check_run_data(session, run.run_spec)
    created = [_create(session, spec, token) for spec in specs]
    _enqueue(session, redis, created)
    return StrategyComparison(runs=[run_out(r) for r in created], skipped=[SkippedStrategy(**s) for s in skipped])


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
            raise errors.InvalidRequest(
                ["query", "status"],
                f"status ({','.join(sorted(unknown))}) is not a run state: {', '.join(lifecycle.TRANSITIONS)}",
                status_filter,
            )
    items, total = runs.list_runs(session, status_filter, name, limit, offset)
    out = [run_out(r) for r in items]
    last = figures.last_step_figures(session, items)
    for row in out:
        row.samples_per_s, row.comm_fraction = last.get(row.id, (None, None))
    return RunPage(items=out, total=total, limit=limit, offset=offset)


@router.get("/{run_id}", response_model=RunOut)
def get_run(run: RunDep, session: SessionDep) -> RunOut:
    out = run_out(run)
    out.samples_per_s, out.comm_fraction = figures.last_step_figures(session, [run]).get(run.id, (None, None))
    out.summary = RunSummary(**figures.run_summary(session, run))
    return out


@router.get("/{run_id}/events", response_model=list[EventOut])
def get_events(run: RunDep, session: SessionDep) -> list[Any]:
    return list(runs.list_events(session, run.id))


@router.post(
    "/{run_id}/cancel",
    response_model=RunOut,
    status_code=status.HTTP_202_ACCEPTED,
    responses={200: {"model": RunOut, "description": "a run that had not started: cancelled at once"}},
)
def cancel_run(run_id: RunId, session: SessionDep, redis: RedisDep, token: Member, response: Response) -> RunOut:
    """202 with ``cancelling`` (again, harmlessly, while it still is) until every process has
    ended; 200 with ``cancelled`` for a run that was not placed; 409 for a run that ended."""
    run = runs.get_run(session, run_id)
    check_owner(run, token, "cancel")
    runs.request_cancel(session, run, f"cancelled by {token.name}")
    session.commit()
    run_signals.signal_cancel(redis, get_settings(), run.id)
    if run.status in TERMINAL:
        response.status_code = status.HTTP_200_OK
    return run_out(run)


@router.get("/{run_id}/metrics/keys", response_model=list[str])
def metric_keys(run: RunDep, session: SessionDep) -> list[str]:
    return metrics.keys(session, run.id)


@router.get("/{run_id}/metrics", responses={200: {"model": MetricSeries}})
def get_metrics(
    run: RunDep,
    session: SessionDep,
    key: Annotated[str, Query(min_length=1, max_length=MAX_KEY_CHARS, description="metric name, e.g. loss")],
    max_points: Annotated[
        int | None,
        Query(
            ge=2,
            le=metrics.MAX_POINTS,
            description="min/max downsampling target (default: TORCHYARD_METRICS_DEFAULT_POINTS, 2,000)",
        ),
    ] = None,
    step_min: Annotated[int | None, Query(ge=0, le=DB_INT_MAX)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=DB_INT_MAX)] = None,
) -> dict[str, Any]:
    points = max_points or get_settings().metrics_default_points  # never every row of a long run at once
    return metrics.series(session, run.id, key, points, step_min, step_max, run.last_step)


@router.get(
    "/{run_id}/metrics/export",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "every point of the key: step, rank, attempt, value, ts (CSV with a header, or JSON)",
            "content": {"text/csv": {"schema": {"type": "string"}}, "application/json": {"schema": {"type": "object"}}},
        },
        404: {"model": Problem, "description": "no such run, or the run never logged the key"},
    },
)
def export_metrics(
    run: RunDep,
    session: SessionDep,
    key: Annotated[str, Query(min_length=1, max_length=MAX_KEY_CHARS, description="metric name, e.g. loss")],
    fmt: Annotated[Literal["csv", "json"], Query(alias="format")] = "csv",
) -> StreamingResponse:
    """A download of one metric at full resolution (no downsampling): per rank and step, the newest
    attempt's value where a resumed attempt logged a step again."""
    known = metrics.keys(session, run.id)
    if key not in known:
        raise errors.NotFound(f"run {run.id} has no metric {key[:100]!r} (it has: {', '.join(known[:50]) or 'none'})")
    session.close()  # the download streams from its own session: it must not hold the request's connection
    filename = f"run-{run.id}-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)[:100]}.{fmt}"
    return StreamingResponse(
        metrics.export(get_sessionmaker(), run.id, key, fmt),
        media_type="text/csv" if fmt == "csv" else "application/json",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


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
    rank: Annotated[int | None, Query(ge=-1, le=DB_INT32_MAX, description="-1: the launcher and elastic agent")] = None,
    after: Annotated[int, Query(ge=0, le=DB_INT_MAX, description="return lines with id greater than this")] = 0,
    before: Annotated[
        int | None,
        Query(ge=1, le=DB_INT_MAX, description="return the last `limit` lines with id less than this (page back)"),
    ] = None,
    tail: Annotated[bool, Query(description="return the last `limit` lines of the log")] = False,
    contains: Annotated[
        str | None, Query(min_length=1, max_length=200, description="only lines holding this text (any case)")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[Any]:
    """Log lines in id order: the first `limit` (after `after`), or the last (`tail`, or before `before`)."""
    if tail and before is None:
        before = DB_INT_MAX
    return list(runs.list_logs(session, run.id, rank, after, limit, before, contains))


@router.get("/{run_id}/stream", response_class=StreamingResponse)
async def stream_run(
    run: RunDep,
    request: Request,
    caller: CallerDep,
    session: SessionDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    since: Annotated[str | None, Query(description="stream id to resume after; '$' for new events only")] = None,
) -> StreamingResponse:
    """Server-Sent Events: every metric batch, log batch and state change of the run, from its
    platform and rank streams merged in id order; each event's id is a cursor over both streams
    (``torchyard.streams``), so a reconnect with Last-Event-ID misses nothing and repeats nothing:
    what ingest has trimmed from the streams comes from the database first (``backend/replay.py``).
    Ends after the run's terminal state has been sent, or within seconds of the caller's token
    being revoked (or its browser session ending)."""
    start = last_event_id or since or "0-0"
    if start != "$" and streams.parse_cursor(start) is None:
        raise errors.InvalidRequest(
            ["header", "Last-Event-ID"],
            f"Last-Event-ID/since ({start[:50]!r}) is not a stream id like 1700000000000-0, nor an event id "
            "like 1700000000000-0_1700000000000-0 (a stream id per stream; each two 64-bit numbers)",
            start[:50],
        )
    finished = run.status in TERMINAL
    # The request's database connection goes back to the pool now, not when the stream ends (a
    # dependency's exit): 15 open streams held the whole pool, and every other request got a 500.
    session.close()
    return live.open_stream(request, run.id, start, finished, caller)
