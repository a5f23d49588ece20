"""Liveness and readiness: the only endpoints that need no token."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status
from sqlalchemy import text

from backend.deps import RedisDep, SessionDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(session: SessionDep, redis: RedisDep) -> dict[str, str]:
    try:
        session.execute(text("SELECT 1"))
        redis.ping()
    except Exception as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"not ready: {exc}") from exc
    return {"status": "ready"}
