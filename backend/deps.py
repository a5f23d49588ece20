"""Request dependencies: the session (the request owns its transaction), the caller's token
(a bearer header, or a browser session's cookie) and role, and the Redis clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any

import redis
import redis.asyncio as aioredis
from fastapi import Depends, HTTPException, Path, Request, status
from sqlalchemy.orm import Session

from backend.db import get_sessionmaker
from backend.models import Dataset, Run, Sweep, Token
from backend.runs import get_run
from backend.security import find_session, find_token, hash_token, role_allows
from torchyard.settings import get_settings

SESSION_COOKIE = "torchyard_session"


async def get_session() -> AsyncIterator[Session]:
    """The request's session. A route that changes state commits it itself, before any side
    effect that must follow the commit (waking the scheduler, telling a worker to cancel).

    The dependencies that read with it (the caller, the run) end their transaction before they
    return (:func:`_done_reading`): each sync dependency runs on a thread of its own, and a
    connection held between them, while the request waits for its next thread, let a burst of
    requests deadlock the pool against the thread pool (threads blocked waiting for connections
    held by requests waiting for threads: 500s after 30 s, at 100 dashboards opening at once).
    For the same reason it is made and closed on the event loop (an async dependency): closing
    it on a thread made a request that had its answer wait for a thread to give its connection
    back."""
    with get_sessionmaker()() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def _done_reading(session: Session) -> None:
    """Gives the session's connection back to the pool (loaded rows stay usable: the sessions do
    not expire them on commit); the next statement takes one again."""
    session.commit()


@lru_cache
def get_redis() -> redis.Redis:
    return redis.Redis.from_url(get_settings().redis_url, socket_timeout=10, health_check_interval=30)


def get_async_redis() -> aioredis.Redis:
    # One per request: an async client is bound to the event loop that made it.
    return aioredis.Redis.from_url(get_settings().redis_url, socket_timeout=None)


RedisDep = Annotated[redis.Redis, Depends(get_redis)]


@dataclass(frozen=True)
class Caller:
    token: Token
    session_hash: str | None  # the browser session the request came with; None: a bearer header


# The role each auth dependency needs. tests/security/test_routes_auth.py derives every route's
# role from the dependencies registered here, so a route without one fails that test.
REQUIRED_ROLE: dict[Callable[..., Any], str] = {}
UNSAFE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def same_origin(request: Request) -> bool:
    """Whether a browser sent this request from this api's own pages. Sec-Fetch-Site when the
    browser sends it, else Origin against our own scheme://host[:port]: another port of the same
    host is another origin, though it shares our cookies (cookies ignore ports)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    return request.headers.get("origin", "").lower() == own.lower()


def current_caller(request: Request, session: SessionDep) -> Caller:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        token = find_token(session, header[7:].strip())
        if token is None:
            raise _unauthorized("missing or invalid token: send 'Authorization: Bearer <token>'")
        _done_reading(session)
        return Caller(token, None)  # a header is never sent by another site's page: no CSRF check
    cookie = request.cookies.get(SESSION_COOKIE)
    if not cookie:
        raise _unauthorized("missing or invalid token: send 'Authorization: Bearer <token>'")
    browser = find_session(session, cookie)
    if browser is None:
        raise _unauthorized("your session has ended or expired: sign in again")
    # The browser attaches the cookie to requests other sites' pages make, too.
    if request.method in UNSAFE_METHODS and not same_origin(request):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"cross-origin {request.method} refused: a session cookie is only accepted from this site's own "
            "pages (send 'Authorization: Bearer <token>' from elsewhere)",
        )
    caller = Caller(browser.token, hash_token(cookie))
    _done_reading(session)
    return caller


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"})


CallerDep = Annotated[Caller, Depends(current_caller)]
REQUIRED_ROLE[current_caller] = "viewer"  # any valid token


def current_token(caller: CallerDep) -> Token:
    return caller.token


def require(role: str) -> Callable[[Token], Token]:
    def check(token: Annotated[Token, Depends(current_token)]) -> Token:
        if not role_allows(token.role, role):
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"this needs the {role} role; your token is {token.role}")
        return token

    REQUIRED_ROLE[check] = role
    return check


Viewer = Annotated[Token, Depends(require("viewer"))]
Member = Annotated[Token, Depends(require("member"))]
Admin = Annotated[Token, Depends(require("admin"))]


# Ids and counters the database holds as 64-bit integers: anything larger is a 422, not an overflow.
DB_INT_MAX = 2**63 - 1
DB_INT32_MAX = 2**31 - 1  # the same for 32-bit columns (ranks)
RunId = Annotated[int, Path(ge=1, le=DB_INT_MAX, description="the run's id")]


def check_owner(resource: Run | Dataset | Sweep, token: Token, action: str) -> None:
    """A member may ``action`` (cancel, diagnose a run; upload to, delete a dataset; cancel a sweep)
    only what is their own; an admin anything."""
    if token.role != "admin" and resource.owner_id != token.id:
        if isinstance(resource, Dataset):
            what = f"dataset {resource.name!r}"
        else:
            what = f"{'run' if isinstance(resource, Run) else 'sweep'} {resource.id}"
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"{what} is not yours; only its owner or an admin may {action} it"
        )


def run_or_404(run_id: RunId, session: SessionDep, _viewer: Viewer) -> Run:
    run = get_run(session, run_id)  # NotFound maps to 404 in one place (backend.app)
    _done_reading(session)
    return run


RunDep = Annotated[Run, Depends(run_or_404)]
