"""A process-wide database (SQLite or PostgreSQL, migrated) and a private Redis holding one run, for
tests that drive ingest and its neighbours in-process, as the ingest process would."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from sqlalchemy.orm import Session

from backend.db import get_engine, get_sessionmaker, transaction
from backend.migrate import upgrade
from backend.models import Attempt, Run
from cli.redis_server import RedisServer
from testkit.stack import run_spec
from torchyard import streams
from torchyard.settings import get_settings

_CACHED = (get_settings, get_engine, get_sessionmaker)


def add_run(session: Session, status: str) -> Run:
    """A run in ``status`` with its first attempt, flushed."""
    run = Run(name="r", status=status, spec=run_spec(), priority=0)
    session.add(run)
    session.flush()
    session.add(Attempt(run_id=run.id, number=1, status=status))
    session.flush()
    return run


@contextmanager
def one_run(
    tmp: Path, database_url: str, monkeypatch: pytest.MonkeyPatch, status: str, rank_stream: bool = False
) -> Iterator[tuple[redis.Redis, int]]:
    """The database at ``database_url`` as the process-wide one, a Redis of its own, and a run in
    ``status`` (its first attempt too) whose streams ingest reads: a client on that Redis and the
    run's id."""
    server = RedisServer(tmp / "redis").start()
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", database_url)
    monkeypatch.setenv("TORCHYARD_REDIS_URL", server.url)
    for cached in _CACHED:
        cached.cache_clear()
    upgrade(database_url)
    with transaction() as session:
        run_id = add_run(session, status).id
    client = redis.Redis.from_url(server.url)
    active = [streams.run_stream(run_id)] + ([streams.rank_stream(run_id)] if rank_stream else [])
    client.sadd(streams.ACTIVE_STREAMS, *active)
    try:
        yield client, run_id
    finally:
        client.close()
        server.stop()
        get_engine().dispose()
        for cached in _CACHED:
            cached.cache_clear()
