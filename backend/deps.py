"""Request dependencies: the session (the request owns its transaction), the caller's token
and role, and the Redis clients."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Annotated

import redis
import redis.asyncio as aioredis
from fastapi import Depends, HTTPException, Path, Request, status
from sqlalchemy.orm import Session

from backend.db import get_sessionmaker
from backend.models import Run, Token
from backend.runs import get_run
from backend.security import find_token, role_allows
from torchyard.settings import get_settings

SESSION_COOKIE = "torchyard_session"


def get_session() -> Iterator[Session]:
    """The request's session. A route that changes state commits it itself, before any side
    effect that must follow the commit (waking the scheduler, telling a worker to cancel)."""
    with get_sessionmaker()() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


@lru_cache
def get_redis() -> redis.Redis:
    return redis.Redis.from_url(get_settings().redis_url, socket_timeout=10, health_check_interval=30)


def get_async_redis() -> aioredis.Redis:
    # One per request: an async client is bound to the event loop that made it.
    return aioredis.Redis.from_url(get_settings().redis_url, socket_timeout=None)


RedisDep = Annotated[redis.Redis, Depends(get_redis)]


def current_token(request: Request, session: SessionDep) -> Token:
    header = request.headers.get("authorization", "")
    value = header[7:].strip() if header.lower().startswith("bearer ") else request.cookies.get(SESSION_COOKIE, "")
    token = find_token(session, value) if value else None
    if token is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or invalid token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token


def require(role: str):  # type: ignore[no-untyped-def]
    def check(token: Annotated[Token, Depends(current_token)]) -> Token:
        if not role_allows(token.role, role):
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"this needs the {role} role; your token is {token.role}")
        return token

    return check


Viewer = Annotated[Token, Depends(require("viewer"))]
Member = Annotated[Token, Depends(require("member"))]
Admin = Annotated[Token, Depends(require("admin"))]


# Ids and counters the database holds as 64-bit integers: anything larger is a 422, not an overflow.
DB_INT_MAX = 2**63 - 1
RunId = Annotated[int, Path(ge=1, le=DB_INT_MAX, description="the run's id")]


def run_or_404(run_id: RunId, session: SessionDep, _viewer: Viewer) -> Run:
    return get_run(session, run_id)  # NotFound maps to 404 in one place (backend.app)


RunDep = Annotated[Run, Depends(run_or_404)]
