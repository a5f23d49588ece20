"""Ingest is idempotent and loses nothing: a redelivered batch changes nothing, entries a dead
consumer read but never acked are taken over, a malformed entry is skipped without blocking
the stream, and a worker's reports drive the run's state. Real Redis, real SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

from backend import lifecycle
from backend.db import get_engine, get_sessionmaker, transaction
from backend.ingest import Ingest, apply_entries
from backend.migrate import upgrade
from backend.models import Attempt, LogLine, Metric, Run
from torchyard import streams
from torchyard.procs import RedisServer
from torchyard.settings import get_settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["sqlite", "postgresql"])
def env(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[redis.Redis, int]]:
    """A migrated database as the process-wide one, a private Redis, and a scheduled run."""
    server = RedisServer(tmp_path / "redis").start()
    url = f"sqlite:///{tmp_path / 'db.sqlite'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", url)
    monkeypatch.setenv("TORCHYARD_REDIS_URL", server.url)
    for cached in (get_settings, get_engine, get_sessionmaker):
        cached.cache_clear()
    upgrade(url)
    with transaction() as session:
        run = Run(name="r", status=lifecycle.SCHEDULED, spec={}, priority=0)
        session.add(run)
        session.flush()
        session.add(Attempt(run_id=run.id, number=1, status=lifecycle.SCHEDULED))
        run_id = run.id
    client = redis.Redis.from_url(server.url)
    client.sadd(streams.ACTIVE_STREAMS, streams.run_stream(run_id))
    yield client, run_id
    client.close()
    server.stop()
    get_engine().dispose()
    for cached in (get_settings, get_engine, get_sessionmaker):
        cached.cache_clear()


def metrics_entry(rank: int, steps: range) -> dict[Any, Any]:
    points = [[s, 1000.0 + s, {"loss": 1.0 / s, "lr": 0.01}] for s in steps]
    return streams.encode(streams.METRICS, {"attempt": 1, "rank": rank, "points": points, "dropped": 0})


def count(model: type[Metric] | type[LogLine], run_id: int) -> int:
    with transaction() as session:
        return session.scalar(select(func.count()).select_from(model).where(model.run_id == run_id)) or 0


def drain(ingest: Ingest) -> None:
    while ingest.poll(block_ms=50):
        pass


def test_a_redelivered_batch_changes_nothing(env: tuple[redis.Redis, int]) -> None:
    client, run_id = env
    stream = streams.run_stream(run_id)
    client.xadd(stream, metrics_entry(0, range(1, 11)))
    client.xadd(stream, metrics_entry(0, range(1, 11)))  # the SDK retried after a lost reply
    client.xadd(stream, streams.encode(streams.LOGS, {"attempt": 1, "lines": [[0, 1.0, "a"], [1, 1.0, "b"]]}))
    drain(Ingest(client))
    assert count(Metric, run_id) == 20 and count(LogLine, run_id) == 2

    everything = [(stream, i.decode(), f) for i, f in client.xrange(stream)]
    with transaction() as session:
        apply_entries(session, everything)  # the whole stream delivered again
    assert count(Metric, run_id) == 20 and count(LogLine, run_id) == 2
    with transaction() as session:
        assert session.get(Run, run_id).last_step == 10  # type: ignore[union-attr]


def test_entries_a_dead_consumer_never_acked_are_taken_over(env: tuple[redis.Redis, int]) -> None:
    client, run_id = env
    stream = streams.run_stream(run_id)
    for rank in (0, 1):
        client.xadd(stream, metrics_entry(rank, range(1, 6)))
    dead = Ingest(client, consumer="dead")
    dead._active()
    assert len(dead._read([stream], ">", None)) == 2  # read, then "crashed" before writing or acking
    assert count(Metric, run_id) == 0

    busy = Ingest(client, consumer="busy")  # alive (its key is fresh) and in the middle of a batch
    client.xadd(stream, metrics_entry(2, range(1, 6)))
    busy.heartbeat()
    assert len(busy._read([stream], ">", None)) == 1

    # the dead one's liveness key never existed (or expired): its entries are taken at the first
    # poll, not after claim_idle_ms (30 s); the busy one's are left to it
    survivor = Ingest(client, consumer="survivor")
    drain(survivor)
    assert count(Metric, run_id) == 20
    pending: Any = client.xpending(stream, streams.INGEST_GROUP)
    assert pending["pending"] == 1
    names = {c["name"].decode() for c in client.xinfo_consumers(stream, streams.INGEST_GROUP)}
    assert "dead" not in names and "busy" in names


def test_a_malformed_entry_is_skipped_without_blocking_the_rest(env: tuple[redis.Redis, int]) -> None:
    client, run_id = env
    stream = streams.run_stream(run_id)
    client.xadd(stream, metrics_entry(0, range(1, 4)))
    client.xadd(stream, {"type": "metrics", "data": "{not json"})
    client.xadd(stream, metrics_entry(1, range(1, 4)))
    drain(Ingest(client))
    assert count(Metric, run_id) == 12
    pending: Any = client.xpending(stream, streams.INGEST_GROUP)
    assert pending["pending"] == 0


def test_worker_reports_move_the_run_and_a_repeated_exit_report_is_ignored(env: tuple[redis.Redis, int]) -> None:
    client, run_id = env
    stream = streams.run_stream(run_id)

    def report(event: str, **fields: Any) -> None:
        client.xadd(stream, streams.encode(streams.REPORT, {"attempt": 1, "node": "n", "event": event, **fields}))

    report("started", pid=1)
    report("exited", status="failed", returncode=1, reason="Traceback: boom")
    report("exited", status="succeeded", returncode=0, reason="")  # a stale duplicate
    drain(Ingest(client))
    with transaction() as session:
        run = session.get(Run, run_id)
        assert run is not None and run.status == lifecycle.FAILED and run.status_reason == "Traceback: boom"
        attempt = session.scalar(select(Attempt).where(Attempt.run_id == run_id))
        assert attempt is not None and attempt.returncode == 1 and attempt.ended_at is not None


def test_rollups_hold_each_blocks_extremes_once_and_long_ranges_read_from_them(env: tuple[redis.Redis, int]) -> None:
    from backend import metrics
    from backend.models import MetricRollup

    client, run_id = env
    stream = streams.run_stream(run_id)
    steps = 20_000
    for rank in (0, 1):
        values = {s: (100.0 if (rank, s) == (1, 12_345) else float(s % 97)) for s in range(1, steps + 1)}
        for start in range(1, steps + 1, 5000):
            points = [[s, float(s), {"loss": values[s]}] for s in range(start, min(steps + 1, start + 5000))]
            entry = streams.encode(streams.METRICS, {"attempt": 1, "rank": rank, "points": points, "dropped": 0})
            client.xadd(stream, entry)
            client.xadd(stream, entry)  # delivered twice: the rollups must not count it twice
    drain(Ingest(client))

    with transaction() as session:
        level6 = session.scalars(
            select(MetricRollup).where(MetricRollup.run_id == run_id, MetricRollup.level == 6)
        ).all()
        assert sum(b.count for b in level6) == 2 * steps
        spike = next(b for b in level6 if b.rank == 1 and b.bucket == 12_345 >> 6)
        assert (spike.max_value, spike.max_step) == (100.0, 12_345)

        coarse = metrics.series(session, run_id, "loss", max_points=200, last_step=steps)
        fine = metrics.series(session, run_id, "loss", max_points=None, last_step=steps)
    assert coarse["bucket_steps"] > 1 and fine["bucket_steps"] == 1
    assert len(coarse["ranks"]["1"]["step"]) <= 200 and len(coarse["aggregate"]["step"]) <= 200
    assert max(coarse["aggregate"]["max"]) == max(fine["aggregate"]["max"]) == 100.0, "the spike survives"
    assert 12_345 in coarse["ranks"]["1"]["step"]
    assert abs(sum(coarse["aggregate"]["mean"]) / len(coarse["aggregate"]["mean"]) - 48.0) < 2.0
