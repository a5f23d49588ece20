"""Metric points are stored once per stream entry (``backend/points.py``): a replayed entry writes
nothing, a batch of stored and new entries writes the new ones, and a point already stored under
another entry (an SDK resend, another ingest at the same moment) sends the batch the careful way;
the rollups hold every stored point once, and a replay from the database reads each entry back as
the stream carried it. Real Redis, SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from backend import lifecycle, points, replay, rollups
from backend.db import transaction
from backend.ingest import Entry, apply_entries
from backend.models import Metric, MetricRollup
from cli.wait import wait_for
from testkit.ingest import one_run
from torchyard import streams

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def careful(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each batch that went the careful way (ON CONFLICT DO NOTHING RETURNING)."""
    calls: list[int] = []
    real = points._insert_returning

    def spy(session: Session, columns: Any) -> list[rollups.NewRow]:
        calls.append(len(columns.steps))
        return real(session, columns)

    monkeypatch.setattr(points, "_insert_returning", spy)
    return calls


def add(client: redis.Redis, run_id: int, rank: int, steps: range, **extra: dict[str, Any]) -> Entry:
    """XADDs a metrics entry of ``steps`` (loss and lr at each, plus ``extra[step]``); returns it."""
    pts = [[s, 1000.0 + s, {"loss": 1.0 / s, "lr": 0.01, **extra.get(str(s), {})}] for s in steps]
    stream = streams.run_stream(run_id)
    entry_id = client.xadd(stream, streams.encode(streams.METRICS, {"attempt": 1, "rank": rank, "points": pts}))
    return stream, entry_id.decode(), client.xrange(stream, entry_id, entry_id)[0][1]


def apply(*entries: Entry) -> int:
    with transaction() as session:
        return apply_entries(session, list(entries))


def exact(run_id: int) -> int:
    """The run's stored points, once its rollups are checked to hold each valued one once."""
    with transaction() as session:
        rows, valued, total = session.execute(
            select(func.count(), func.count(Metric.value), func.sum(Metric.value)).where(Metric.run_id == run_id)
        ).one()
        for level in rollups.LEVELS:
            count, summed = session.execute(
                select(func.sum(MetricRollup.count), func.sum(MetricRollup.sum)).where(
                    MetricRollup.run_id == run_id, MetricRollup.level == level
                )
            ).one()
            assert (count or 0) == valued and (summed or 0.0) == pytest.approx(total or 0.0), f"level {level}"
    return int(rows)


def test_a_replayed_entry_writes_nothing_twice_and_rollups_stay_exact(
    ingest_run: tuple[redis.Redis, int], careful: list[int]
) -> None:
    client, run_id = ingest_run
    both = [add(client, run_id, 0, range(1, 101)), add(client, run_id, 1, range(1, 101))]
    assert apply(*both) == 400
    assert apply(*both) == 0  # delivered again: the ingest died after its commit, before its ack
    assert exact(run_id) == 400
    assert careful == [], "a replay is found by its entries, not by a failed insert"


def test_a_batch_of_stored_and_new_entries_writes_the_new_ones_as_they_came(
    ingest_run: tuple[redis.Redis, int], careful: list[int]
) -> None:
    client, run_id = ingest_run
    first = add(client, run_id, 0, range(1, 51))
    assert apply(first) == 100
    # a ragged entry: keys of other lengths at some steps, NaN and null values (stored as NULL)
    ragged = add(client, run_id, 0, range(51, 61), **{"55": {"grad_norm": float("nan")}, "57": {"x": None}})
    new = add(client, run_id, 1, range(1, 31))
    assert apply(first, ragged, new) == 20 + 2 + 60
    assert exact(run_id) == 182
    assert careful == []
    with transaction() as session:
        nulls = session.scalar(select(func.count()).where(Metric.run_id == run_id, Metric.value.is_(None)))
        assert nulls == 2
        # read back from the database, each entry is the one the stream carried (NULLs as None)
        page = replay.read(session, run_id, False, "0-0", streams.id_after(new[1]))
    assert len(page.entries) == 3
    carried = {entry_id: streams.decode(fields)[1]["points"] for _, entry_id, fields in (first, ragged, new)}
    for entry_id, _, data in page.entries:
        expected = [
            [s, ts, {k: (None if v is None or v != v else v) for k, v in values.items()}]
            for s, ts, values in carried[entry_id]
        ]
        assert data["points"] == expected


def test_a_point_stored_under_another_entry_sends_the_batch_the_careful_way(
    ingest_run: tuple[redis.Redis, int], careful: list[int]
) -> None:
    """The SDK resent steps 41-50 in a new entry after a lost reply, with steps 51-100."""
    client, run_id = ingest_run
    assert apply(add(client, run_id, 0, range(1, 51))) == 100
    assert apply(add(client, run_id, 0, range(41, 101))) == 100
    assert careful == [120]
    assert exact(run_id) == 200


def test_an_entry_another_ingest_stored_after_the_check_is_not_written_twice(
    ingest_run: tuple[redis.Redis, int], careful: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, run_id = ingest_run
    entry = add(client, run_id, 0, range(1, 51))
    assert apply(entry) == 100
    # the other ingest committed the entry between this one's check and its insert
    monkeypatch.setattr(points.Points, "_not_stored", lambda self, session: self.segments)
    assert apply(entry) == 0
    assert careful == [100]
    assert exact(run_id) == 100


def test_two_ingests_writing_one_entry_at_once_store_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str, careful: list[int]
) -> None:
    """PostgreSQL: the second one's insert waits on the first's uncommitted points, then finds them
    stored and goes the careful way (SQLite has one writer: the second waits before it reads)."""
    with one_run(tmp_path, pg_url, monkeypatch, lifecycle.SCHEDULED) as (client, run_id):
        assert apply(add(client, run_id, 0, range(1, 11))) == 20  # its keys known: no bound's lock to wait on
        entry = add(client, run_id, 0, range(11, 61))
        second: list[int] = []
        other = threading.Thread(target=lambda: second.append(apply(entry)), daemon=True)
        with transaction() as session:
            assert apply_entries(session, [entry]) == 100
            other.start()

            def waiting() -> bool:
                with transaction() as watcher:
                    query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
                    return bool(watcher.scalar(text(query)))

            wait_for(waiting, 30, "the second ingest to wait on the first's points")
        other.join(30)
        assert second == [0] and careful == [100]
        assert exact(run_id) == 120
