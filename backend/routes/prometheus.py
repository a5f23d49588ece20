"""/metrics: the platform's own health in Prometheus' text format (a viewer token, like every
other endpoint: Prometheus sends one with `authorization: {credentials: ...}`)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from sqlalchemy import func, select

from backend import lifecycle, nodes
from backend.deps import RedisDep, SessionDep, Viewer
from backend.models import Node, Run
from torchyard import streams

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=PlainTextResponse)
def prometheus(session: SessionDep, redis: RedisDep, _viewer: Viewer) -> str:
    lines: list[str] = []

    def gauge(name: str, help_text: str, samples: list[tuple[dict[str, str], float]], kind: str = "gauge") -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        for labels, value in samples:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")

    by_status = dict(session.execute(select(Run.status, func.count()).group_by(Run.status)).all())
    gauge("torchyard_runs", "Runs by state.", [({"status": s}, by_status.get(s, 0)) for s in lifecycle.TRANSITIONS])
    oldest = session.scalar(select(func.min(Run.created_at)).where(Run.status == lifecycle.QUEUED))
    gauge("torchyard_queue_depth", "Runs waiting to be placed.", [({}, by_status.get(lifecycle.QUEUED, 0))])
    wait = time.time() - oldest.timestamp() if oldest else 0.0
    gauge("torchyard_queue_oldest_wait_seconds", "How long the oldest queued run has waited.", [({}, round(wait, 3))])

    node_rows = session.execute(select(Node.status, func.count(), func.sum(Node.slots)).group_by(Node.status)).all()
    gauge("torchyard_nodes", "Worker nodes by state.", [({"status": s}, n) for s, n, _ in node_rows])
    alive_slots = sum(int(total or 0) for s, _, total in node_rows if s == "alive")
    gauge("torchyard_slots", "Process slots of alive nodes.", [({}, alive_slots)])
    gauge("torchyard_slots_free", "Free process slots of alive nodes.", [({}, sum(nodes.free_slots(session).values()))])

    backlog, oldest_ms = _stream_backlog(redis)
    gauge("torchyard_stream_backlog_entries", "Stream entries ingest has not written yet.", [({}, backlog)])
    lag = max(0.0, time.time() - oldest_ms / 1000) if oldest_ms else 0.0
    gauge("torchyard_ingest_lag_seconds", "Age of the oldest entry ingest has not written.", [({}, round(lag, 3))])
    written = int(redis.get(streams.INGESTED_POINTS) or 0)  # type: ignore[arg-type]
    gauge("torchyard_ingest_points_total", "Metric points ingest has written.", [({}, written)], kind="counter")
    return "\n".join(lines) + "\n"


def _stream_backlog(redis: Any) -> tuple[int, int | None]:
    """Entries not yet written (pending + never delivered) over every active run stream, and the
    time (ms) of the oldest of them."""
    backlog, oldest_ms = 0, None
    for raw in redis.smembers(streams.ACTIVE_STREAMS):
        key = raw.decode()
        group = next((g for g in redis.xinfo_groups(key) if g["name"] == streams.INGEST_GROUP.encode()), None)
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
