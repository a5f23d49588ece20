"""/metrics: the platform's own health (``backend/stats.py``) in Prometheus' text format (a viewer
token, like every other endpoint: Prometheus sends one with `authorization: {credentials: ...}`)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from backend import stats
from backend.deps import RedisDep, SessionDep, Viewer

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=PlainTextResponse)
def prometheus(session: SessionDep, redis: RedisDep, _viewer: Viewer) -> str:
    lines: list[str] = []
    for series in stats.collect(session, redis):
        lines.extend([f"# HELP {series.name} {series.help}", f"# TYPE {series.name} {series.kind}"])
        for labels, value in series.samples:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{series.name}{{{label_text}}} {value}" if label_text else f"{series.name} {value}")
    return "\n".join(lines) + "\n"
