"""The api: REST under /api/v1, the live stream, health checks and the built front end.
Domain errors map to HTTP here, in one place."""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import OperationalError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend import lifecycle
from backend.db import REQUEST_SLOTS
from backend.deps import get_redis
from backend.errors import Conflict, InvalidRequest, LimitExceeded, NotFound
from backend.routes import (
    bundles,
    checkpoints,
    datasets,
    diagnosis,
    health,
    nodes,
    pools,
    projection,
    prometheus,
    runs,
    session,
    stragglers,
    sweeps,
    tokens,
)
from torchyard.settings import get_settings

log = logging.getLogger(__name__)
DATABASE_RETRY_AFTER_S = 1  # a 503's Retry-After when the database was busy (another writer's lock)
CHECKOUT_DIST = Path(__file__).resolve().parent.parent / "frontend" / "dist"  # a source checkout's build

# Every response: only our own scripts, styles and images run (the built front end has no inline
# script or style: Preact and uPlot set styles through the DOM, which CSP allows); no framing
# (clickjacking); no MIME sniffing; no Referer (a URL may carry a bundle capability).
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"frame-ancestors 'none'; object-src 'none'; base-uri 'none'; form-action 'self'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
# Query parameters that carry secrets; their values never reach a log line or an error body.
SECRET_PARAMS = re.compile(r"([?&](?:cap|token)=)[^&\s]*", re.IGNORECASE)
SECRET_FIELDS = {"token", "cap", "X-Bundle-Capability", "authorization", "cookie"}


class SecurityHeaders:
    """Pure ASGI (not BaseHTTPMiddleware, which would get between the live stream and its
    client's disconnect)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class RequestSlots:
    """At most ``slots`` requests at a time between arriving and starting their answer, the rest
    waiting here on the event loop (pure ASGI, like :class:`SecurityHeaders`). Sync routes and
    dependencies each run on a worker thread and may hold a database connection between threads;
    with more requests in that stretch than the pool has connections, threads blocked waiting for
    a connection that a request waiting for a thread held (a deadlock the pool's 30 s timeout
    broke with 500s: 150 requests at once did it). Fewer slots than connections (``backend.db``)
    means a connection is always free. A live stream gives its slot back when its answer starts."""

    def __init__(self, app: ASGIApp, slots: int) -> None:
        self.app = app
        self.limiter = asyncio.Semaphore(slots)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        await self.limiter.acquire()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.limiter.release()

        async def send_releasing(message: Message) -> None:
            if message["type"] == "http.response.start":
                release()
            await send(message)

        try:
            await self.app(scope, receive, send_releasing)
        finally:
            release()


class _RedactSecrets(logging.Filter):
    """uvicorn's access log writes each request's path with its query: hide `cap=` and `token=`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(SECRET_PARAMS.sub(r"\1[redacted]", a) if isinstance(a, str) else a for a in record.args)
        return True


@asynccontextmanager
async def _lifespan(_app: FastAPI) -> AsyncIterator[None]:
    lifecycle.set_publisher(get_redis())  # state changes reach live viewers once committed
    access = logging.getLogger("uvicorn.access")  # configured by now: uvicorn set it up before startup
    if not any(isinstance(f, _RedactSecrets) for f in access.filters):
        access.addFilter(_RedactSecrets())
    yield


def create_app() -> FastAPI:
    app = FastAPI(
        title="torchyard",
        version="0.1.0",
        description="Run and watch distributed PyTorch training.",
        max_body_size=get_settings().max_request_bytes,
        lifespan=_lifespan,
        # No /docs, /redoc or /openapi.json: every route but health and login needs a token (the
        # schema is frontend/openapi.json, dumped from app.openapi()), and CSP blocks Swagger's CDN.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(SecurityHeaders)
    app.add_middleware(RequestSlots, slots=REQUEST_SLOTS)
    for module in (
        health,
        runs,
        stragglers,
        projection,
        checkpoints,
        diagnosis,
        nodes,
        pools,
        session,
        tokens,
        prometheus,
        bundles,
        datasets,
        sweeps,
    ):
        app.include_router(module.router)

    @app.exception_handler(NotFound)
    async def _not_found(_request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_404_NOT_FOUND)

    @app.exception_handler(Conflict)
    async def _conflict(_request: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_409_CONFLICT)

    @app.exception_handler(LimitExceeded)
    async def _limit(_request: Request, exc: LimitExceeded) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_429_TOO_MANY_REQUESTS)

    @app.exception_handler(OperationalError)
    async def _database_busy(_request: Request, exc: OperationalError) -> JSONResponse:
        # A lock another writer held past the busy timeout (SQLite's "database is locked"), a
        # serialization failure or deadlock (PostgreSQL), or the database out of reach: the request
        # changed nothing (its transaction rolled back), so the client may send it again.
        cause = str(exc.orig).splitlines()[0] if exc.orig else type(exc).__name__
        log.warning("database unavailable for %s %s: %s", _request.method, _request.url.path, cause)
        return JSONResponse(
            {"detail": f"the database is busy or out of reach ({cause}): nothing was changed; try again"},
            status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
        )

    @app.exception_handler(InvalidRequest)
    async def _invalid(_request: Request, exc: InvalidRequest) -> JSONResponse:
        error = {"type": "value_error", "loc": exc.loc, "msg": exc.msg, "input": exc.value}
        return JSONResponse({"detail": [error]}, status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(RequestValidationError)
    async def _unprocessable(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler, but a secret sent malformed (a too-long token) is not echoed, and
        # an input of NaN or ±Infinity (which Python's json reads, as it reads 1e400) is echoed as a
        # string: JSON cannot carry it, and a 422 must not become a 500 while it is being written.
        errors = _json_safe(jsonable_encoder([_located(error) for error in exc.errors()]))
        for error in errors:
            if request.url.path == "/api/v1/session" or SECRET_FIELDS & {str(part) for part in error["loc"]}:
                error.pop("input", None)
        return JSONResponse({"detail": errors}, status.HTTP_422_UNPROCESSABLE_CONTENT)

    dist = get_settings().frontend_dist or CHECKOUT_DIST
    if dist.is_dir():
        app.mount("/", StaticFiles(directory=dist, html=True), name="frontend")
    else:  # the api still works; say why the page is missing
        log.warning("no dashboard at %s: build it (cd frontend && npm run build) or set TORCHYARD_FRONTEND_DIST", dist)
    return app


_NAMED_FIELD = re.compile(r"^(?:Value error, )?([a-z_]+(?:\.[a-z_]+)+) \(")


def _located(error: dict[str, Any]) -> dict[str, Any]:
    """A rule across fields (RunSpec's after-validators) fails on the whole spec: pydantic gives it
    no field path and echoes the whole spec as its input. Its message starts with the field it is
    about ("training.batch_size (63) must be divisible by ..."): make that the path, and its value
    the input."""
    match = _NAMED_FIELD.match(str(error.get("msg", "")))
    if not match or len(error.get("loc", ())) > 1 or not isinstance(error.get("input"), dict):
        return error
    path = match.group(1).split(".")
    value: Any = error["input"]
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return {**error, "loc": [*error.get("loc", ()), *path], "input": value}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
