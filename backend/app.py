"""The api: REST under /api/v1, the live stream, health checks and the built front end.
Domain errors map to HTTP here, in one place."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, status
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from backend import lifecycle
from backend.deps import get_redis
from backend.routes import bundles, checkpoints, health, nodes, prometheus, runs, session, tokens
from backend.runs import InvalidRequest, LimitExceeded, NotFound
from torchyard.settings import get_settings

log = logging.getLogger(__name__)
FRONTEND_DIST = Path(__file__).resolve().parent.parent / "frontend" / "dist"


@asynccontextmanager
async def _lifespan(_app: FastAPI) -> AsyncIterator[None]:
    lifecycle.set_publisher(get_redis())  # state changes reach live viewers once committed
    yield


def create_app() -> FastAPI:
    app = FastAPI(
        title="torchyard",
        version="0.1.0",
        description="Run and watch distributed PyTorch training.",
        max_body_size=get_settings().max_request_bytes,
        lifespan=_lifespan,
    )
    for module in (health, runs, checkpoints, nodes, session, tokens, prometheus, bundles):
        app.include_router(module.router)

    @app.exception_handler(NotFound)
    async def _not_found(_request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_404_NOT_FOUND)

    @app.exception_handler(lifecycle.IllegalTransition)
    async def _conflict(_request: Request, exc: lifecycle.IllegalTransition) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_409_CONFLICT)

    @app.exception_handler(LimitExceeded)
    async def _limit(_request: Request, exc: LimitExceeded) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_429_TOO_MANY_REQUESTS)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_request: Request, exc: InvalidRequest) -> JSONResponse:
        error = {"type": "value_error", "loc": exc.loc, "msg": exc.msg, "input": exc.value}
        return JSONResponse({"detail": [error]}, status.HTTP_422_UNPROCESSABLE_CONTENT)

    if FRONTEND_DIST.is_dir():
        app.mount("/", StaticFiles(directory=FRONTEND_DIST, html=True), name="frontend")
    return app
