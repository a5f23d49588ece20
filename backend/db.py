"""Engine and sessions. SQLite (the embedded default) gets WAL and a busy timeout, because
api, scheduler and ingest write to one file from separate processes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from torchyard.settings import get_settings

# As many connections as threads that may want one at once: the api runs sync routes and
# dependencies on anyio's 40 worker threads, so a burst of requests (100 dashboards opening their
# live streams) never waits on the pool (it timed out after 30 s with a 500 on a busy machine).
POOL_SIZE, POOL_OVERFLOW = 10, 30
# Requests the api lets into its routes at once (backend.app.RequestSlots): fewer than the pool's
# connections, so a request's thread never waits for one; the rest are for the api's own loops
# (the scheduler, live streams' re-checks).
REQUEST_SLOTS = POOL_SIZE + POOL_OVERFLOW - 8


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        busy_s = get_settings().sqlite_busy_timeout_s
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": busy_s},
            pool_size=POOL_SIZE,
            max_overflow=POOL_OVERFLOW,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_s * 1000)}")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW)


@lru_cache
def get_engine() -> Engine:
    return make_engine(get_settings().sqlalchemy_url)


@lru_cache
def get_sessionmaker() -> sessionmaker[Session]:
    return sessionmaker(get_engine(), expire_on_commit=False)


@contextmanager
def transaction() -> Iterator[Session]:
    """A session whose work commits at the end of the block, or rolls back on error."""
    with get_sessionmaker()() as session, session.begin():
        yield session
