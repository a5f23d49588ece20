"""The platform's own health figures (what /metrics serves in Prometheus' text format)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend import alerts, lifecycle, limits, live, nodes
from backend.models import Node, Run, RunCounter, RunEvent
from torchyard import streams
from torchyard.states import NodeState


class Series(NamedTuple):
    """One Prometheus metric: its name, help, samples (labels, value) and type."""

    name: str
    help: str
    samples: list[tuple[dict[str, str], float]]
    kind: str = "gauge"


def collect(session: Session, redis: Any) -> list[Series]:
    """Runs by state, the queue, nodes and slots, the streams' backlog and ingest's lag, points
    written, dropped at a bound and refused: read from the database and Redis, never failing on a
    key of the wrong type."""
    out: list[Series] = []

    def gauge(name: str, help_text: str, samples: list[tuple[dict[str, str], float]], kind: str = "gauge") -> None:
        out.append(Series(name, help_text, samples, kind))

    by_status = dict(session.execute(select(Run.status, func.count()).group_by(Run.status)).all())
    gauge("torchyard_runs", "Runs by state.", [({"status": s}, by_status.get(s, 0)) for s in lifecycle.TRANSITIONS])
    oldest = session.scalar(select(func.min(Run.created_at)).where(Run.status == lifecycle.QUEUED))
    gauge("torchyard_queue_depth", "Runs waiting to be placed.", [({}, by_status.get(lifecycle.QUEUED, 0))])
    wait = time.time() - oldest.timestamp() if oldest else 0.0
    gauge("torchyard_queue_oldest_wait_seconds", "How long the oldest queued run has waited.", [({}, round(wait, 3))])

    node_rows = session.execute(select(Node.status, func.count(), func.sum(Node.slots)).group_by(Node.status)).all()
    gauge("torchyard_nodes", "Worker nodes by state.", [({"status": s}, n) for s, n, _ in node_rows])
    alive_slots = sum(int(total or 0) for s, _, total in node_rows if s == NodeState.ALIVE)
    gauge("torchyard_slots", "Process slots of alive nodes.", [({}, alive_slots)])
    free = nodes.free_capacity(session)
    gauge("torchyard_slots_free", "Free process slots of alive nodes.", [({}, sum(f.slots for f in free.values()))])
    alive_gpus = sum(len(n.gpus) for n in session.scalars(select(Node).where(Node.status == NodeState.ALIVE)))
    gauge("torchyard_gpus", "GPUs of alive nodes.", [({}, alive_gpus)])
    gauge("torchyard_gpus_free", "GPUs of alive nodes no run holds.", [({}, sum(len(f.gpus) for f in free.values()))])

    backlog, oldest_ms = _stream_backlog(redis)
    gauge("torchyard_stream_backlog_entries", "Stream entries ingest has not written yet.", [({}, backlog)])
    lag = max(0.0, time.time() - oldest_ms / 1000) if oldest_ms else 0.0
    gauge("torchyard_ingest_lag_seconds", "Age of the oldest entry ingest has not written.", [({}, round(lag, 3))])
    written = _counter(lambda: int(redis.get(streams.INGESTED_POINTS) or 0))
    gauge("torchyard_ingest_points_total", "Metric points ingest has written.", [({}, written)], kind="counter")
    dropped = dict(
        session.execute(
            select(RunCounter.name, func.sum(RunCounter.value))
            .where(RunCounter.name.in_(list(limits.Drop)))
            .group_by(RunCounter.name)
        ).all()
    )
    gauge(
        "torchyard_ingest_dropped_total",
        "Metric points and log lines ingest dropped or cut at a bound (README: Limits), by kind.",
        [({"kind": kind}, int(dropped.get(kind) or 0)) for kind in limits.Drop],
        kind="counter",
    )
    refused: Any = _counter(lambda: redis.hgetall(streams.REJECTED), {})
    gauge(
        "torchyard_rejected_total",
        "Stream entries and keys ingest or the scheduler refused (from ranks: wrong type, attempt, rank, size).",
        [({"reason": k.decode(errors="replace")}, int(v)) for k, v in sorted(refused.items())],
        kind="counter",
    )
    raised = dict(
        session.execute(
            select(RunEvent.alert, func.count()).where(RunEvent.alert.is_not(None)).group_by(RunEvent.alert)
        ).all()
    )
    gauge(
        "torchyard_run_alerts_total",
        "Live alerts raised on runs (backend/alerts.py), by kind: throughput fell below, or comm fraction rose "
        "above, the run's own moving baseline.",
        [({"kind": kind}, int(raised.get(kind) or 0)) for kind in alerts.AlertKind],
        kind="counter",
    )
    gauge(
        "torchyard_run_alert",
        "1 for each live alert that holds on a running run now, by run and kind.",
        [({"run": str(run_id), "kind": kind}, 1) for run_id, kind in alerts.active(session)],
    )
    live_now = live.figures()
    gauge("torchyard_live_streams", "Live streams (SSE) open in this api process.", [({}, live_now["streams"])])
    gauge(
        "torchyard_live_feeds",
        "Shared readers in this api process: one per run watched by viewers caught up with its streams.",
        [({}, live_now["feeds"])],
    )
    gauge("torchyard_live_feed_viewers", "Live streams reading from a shared reader.", [({}, live_now["feed_viewers"])])
    gauge(
        "torchyard_live_feed_joined_total",
        "Viewers that joined a shared reader (a viewer left behind joins again once it caught up).",
        [({}, live_now["joined"])],
        kind="counter",
    )
    gauge(
        "torchyard_live_feed_left_behind_total",
        "Viewers that fell live_feed_backlog batches behind a shared reader (each then read on its own).",
        [({}, live_now["left_behind"])],
        kind="counter",
    )
    return out


def _counter(read: Any, default: Any = 0) -> Any:
    """A value read from Redis, or ``default`` when the key holds something else (WRONGTYPE,
    junk): /metrics reports what it can and never fails on a bad key."""
    try:
        return read()
    except Exception:
        return default


def _stream_backlog(redis: Any) -> tuple[int, int | None]:
    """Entries not yet written (pending + never delivered) over every active run stream, and the
    time (ms) of the oldest of them."""
    backlog, oldest_ms = 0, None
    members: Any = _counter(lambda: redis.smembers(streams.ACTIVE_STREAMS), set())
    for raw in members:
        key = raw.decode(errors="replace")
        if streams.parse_stream(key) is None:
            continue  # not a run stream: ingest drops it from the set
        try:
            groups: Any = redis.xinfo_groups(key)
        except Exception:
            continue
        group = next((g for g in groups if g["name"] == streams.INGEST_GROUP.encode()), None)
        if group is None:
            continue
        backlog += int(group["pending"]) + int(group.get("lag") or 0)
        first_unwritten = redis.xpending_range(key, streams.INGEST_GROUP, "-", "+", 1) or redis.xrange(
            key, min=f"({group['last-delivered-id'].decode()}", count=1
        )
        if first_unwritten:
            entry_id = (
                first_unwritten[0]["message_id"] if isinstance(first_unwritten[0], dict) else first_unwritten[0][0]
            )
            ms = int(entry_id.decode().split("-")[0])
            oldest_ms = ms if oldest_ms is None else min(oldest_ms, ms)
    return backlog, oldest_ms
