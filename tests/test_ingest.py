"""Ingest is idempotent and loses nothing: a redelivered batch changes nothing, entries a dead
consumer read but never acked are taken over, a malformed entry is skipped without blocking
the stream, and a worker's reports drive the run's state. Real Redis, real SQLite."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

from backend import lifecycle
from backend.db import transaction
from backend.ingest import Ingest, apply_entries
from backend.models import Attempt, LogLine, Metric, Run
from torchyard import streams
from torchyard.settings import get_settings

pytestmark = pytest.mark.timeout(60)


def metrics_entry(rank: int, steps: range, dropped: int = 0) -> dict[Any, Any]:
    points = [[s, 1000.0 + s, {"loss": 1.0 / s, "lr": 0.01}] for s in steps]
    return streams.encode(streams.METRICS, {"attempt": 1, "rank": rank, "points": points, "dropped": dropped})


def count(model: type[Metric] | type[LogLine], run_id: int) -> int:
    with transaction() as session:
        return session.scalar(select(func.count()).select_from(model).where(model.run_id == run_id)) or 0


def drain(ingest: Ingest) -> None:
    while ingest.poll(block_ms=50):
        pass


def test_a_redelivered_batch_changes_nothing(ingest_run: tuple[redis.Redis, int]) -> None:
    client, run_id = ingest_run
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


def test_live_viewers_hear_how_far_behind_storage_is_and_what_each_rank_dropped(
    ingest_run: tuple[redis.Redis, int],
) -> None:
    client, run_id = ingest_run
    stream, key = streams.run_stream(run_id), streams.ingested_key(run_id)
    client.xadd(stream, metrics_entry(0, range(1, 6)))
    client.xadd(stream, metrics_entry(1, range(1, 6), dropped=7))
    ingest = Ingest(client)
    ingest.progress_every_s = 3600  # only a grown drop count is told again
    drain(ingest)
    first = json.loads(client.get(key))  # type: ignore[arg-type]
    assert first["sdk_dropped"] == {"0": 0, "1": 7} and 0 <= first["lag_s"] < 30
    assert 0 < client.ttl(key) <= streams.INGESTED_TTL_S, "the word expires: nothing of an ended run stays"
    client.set(key, "{}", keepttl=True)  # a marker: was the word rewritten?
    client.xadd(stream, metrics_entry(0, range(6, 8)))
    drain(ingest)
    assert client.get(key) == b"{}", "nothing new dropped, and the last word is recent: not told again"
    client.xadd(stream, metrics_entry(1, range(6, 8), dropped=9))
    drain(ingest)
    assert json.loads(client.get(key))["sdk_dropped"] == {"0": 0, "1": 9}  # type: ignore[arg-type]
    assert count(Metric, run_id) == 2 * 7 * 2
    assert not [f for _, f in client.xrange(stream) if streams.decode(f)[0] == streams.INGESTED], "never a stream entry"


def test_a_backlog_of_small_entries_is_one_batch_up_to_its_byte_bound(
    ingest_run: tuple[redis.Redis, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, run_id = ingest_run
    stream = streams.run_stream(run_id)
    for step in range(1, 21):  # the SDK sends as soon as it is idle: many entries of a point or two
        client.xadd(stream, metrics_entry(step % 2, range(step, step + 1)))
    ingest = Ingest(client, batch=3)  # 3 entries a read
    ingest._active()
    assert ingest.poll(block_ms=50) == 20, "reads on while the stream holds more: one transaction"
    assert count(Metric, run_id) == 40

    size = sum(len(v) for v in metrics_entry(0, range(100, 101)).values())
    monkeypatch.setattr("backend.ingest.BATCH_BYTES", 5 * size)
    for step in range(100, 120):
        client.xadd(stream, metrics_entry(0, range(step, step + 1)))
    sizes = []
    while handled := ingest.poll(block_ms=50):
        sizes.append(handled)
    assert sizes == [6, 6, 6, 2], "reads of 3 until the bound (5 entries' bytes) is passed"
    assert count(Metric, run_id) == 80
    pending: Any = client.xpending(stream, streams.INGEST_GROUP)
    assert pending["pending"] == 0, "every entry acked (several ids in one XACK)"


def test_entries_a_dead_consumer_never_acked_are_taken_over(ingest_run: tuple[redis.Redis, int]) -> None:
    client, run_id = ingest_run
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


def test_a_malformed_entry_is_skipped_without_blocking_the_rest(ingest_run: tuple[redis.Redis, int]) -> None:
    client, run_id = ingest_run
    stream = streams.run_stream(run_id)
    client.xadd(stream, metrics_entry(0, range(1, 4)))
    client.xadd(stream, {"type": "metrics", "data": "{not json"})
    client.xadd(stream, metrics_entry(1, range(1, 4)))
    drain(Ingest(client))
    assert count(Metric, run_id) == 12
    pending: Any = client.xpending(stream, streams.INGEST_GROUP)
    assert pending["pending"] == 0


def test_worker_reports_move_the_run_and_a_repeated_exit_report_is_ignored(ingest_run: tuple[redis.Redis, int]) -> None:
    client, run_id = ingest_run
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


def test_rollups_hold_each_blocks_extremes_once_and_long_ranges_read_from_them(
    ingest_run: tuple[redis.Redis, int],
) -> None:
    from backend import metrics
    from backend.models import MetricRollup

    client, run_id = ingest_run
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


def test_a_wide_view_after_a_resume_shows_the_newest_attempt(ingest_run: tuple[redis.Redis, int]) -> None:
    """Attempt 1 logged steps 1–15,000 (loss 5.0), attempt 2 resumed at 10,000 and logged
    10,001–20,000 (loss 1.0): a view wide enough to read rollups shows 1.0 for every replayed step,
    as the rows do, and the across-rank mean of a block is 5.0 before the resume and 1.0 after it
    (it was 3.0 while rollups merged the attempts)."""
    from backend import metrics

    client, run_id = ingest_run
    stream = streams.run_stream(run_id)
    for attempt, first, last, loss in ((1, 1, 15_000, 5.0), (2, 10_001, 20_000, 1.0)):
        for rank in (0, 1):
            for start in range(first, last + 1, 5000):
                points = [[s, float(s), {"loss": loss}] for s in range(start, min(last + 1, start + 5000))]
                client.xadd(stream, streams.encode(streams.METRICS, {"attempt": attempt, "rank": rank,
                                                                     "points": points, "dropped": 0}))  # fmt: skip
    drain(Ingest(client))

    with transaction() as session:
        wide = metrics.series(session, run_id, "loss", max_points=200, last_step=20_000)
        raw = metrics.series(session, run_id, "loss", max_points=None, last_step=20_000)
    assert wide["bucket_steps"] > 1, "the view must be wide enough to read rollups"
    for view in (wide, raw):
        for rank in ("0", "1"):
            for step, value in zip(view["ranks"][rank]["step"], view["ranks"][rank]["value"], strict=True):
                assert value == (5.0 if step <= 10_000 else 1.0), (view["bucket_steps"], rank, step, value)
    # a block's mean is over its steps: only the block holding step 10,000 mixes the two
    width = wide["bucket_steps"]
    means = dict(zip(wide["aggregate"]["step"], wide["aggregate"]["mean"], strict=True))
    assert {m for s, m in means.items() if s // width > 10_000 // width} == {1.0}
    assert {m for s, m in means.items() if s // width < 10_000 // width} == {5.0}


def bounded(monkeypatch: pytest.MonkeyPatch, **limits: int) -> None:
    for name, value in limits.items():
        monkeypatch.setenv(f"TORCHYARD_{name.upper()}", str(value))
    get_settings.cache_clear()


def warnings_of(run_id: int) -> dict[str, tuple[int, str]]:
    """The run's bound warnings: kind → (line id, text)."""
    with transaction() as session:
        rows = session.execute(
            select(LogLine.entry_id, LogLine.id, LogLine.text).where(
                LogLine.run_id == run_id, LogLine.entry_id.like("limit:%")
            )
        ).all()
    return {entry_id.removeprefix("limit:"): (line_id, text) for entry_id, line_id, text in rows}


def test_metric_keys_past_the_bounds_are_dropped_counted_and_said(
    ingest_run: tuple[redis.Redis, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from backend import metrics
    from backend.limits import Drop

    client, run_id = ingest_run
    bounded(monkeypatch, max_metric_keys=5)
    stream = streams.run_stream(run_id)
    long_key = "x" * (streams.MAX_KEY_CHARS + 1)
    client.xadd(stream, metrics_entry(0, range(1, 4)))  # the run's own keys arrive first
    drain(Ingest(client))
    for step in range(1, 4):  # then a flood of new ones (a batch admits its new keys in sorted order)
        values = {f"junk{k:02d}": 1.0 for k in range(10)} | {long_key: 2.0}
        entry = {"attempt": 1, "rank": 1, "points": [[step, 1.0, values]], "dropped": 0}
        client.xadd(stream, streams.encode(streams.METRICS, entry))
    drain(Ingest(client))

    with transaction() as session:
        keys = metrics.keys(session, run_id)
        assert keys == ["junk00", "junk01", "junk02", "loss", "lr"], "the first 5 keys"
        loss = metrics.series(session, run_id, "loss", None)
        assert loss["ranks"]["0"]["step"] == [1, 2, 3], "the run's own keys: every step, once"
        # the long key lands nowhere, not even cut short
        stored = session.scalars(select(Metric.key).where(Metric.run_id == run_id).distinct()).all()
    assert set(stored) == set(keys)
    warned = warnings_of(run_id)
    assert warned[Drop.LONG_KEY][1].endswith("dropped 3 metric points whose key is longer than 200 characters")
    assert (
        "dropped 21 metric points of new keys past this run's limit of 5 keys (TORCHYARD_MAX_METRIC_KEYS)"
        in (warned[Drop.KEY_LIMIT][1])
    )  # 7 junk keys × 3 steps

    client.xadd(stream, streams.encode(streams.METRICS, {"attempt": 1, "rank": 0, "points": [[4, 1.0, {"new": 1}]]}))
    drain(Ingest(client))
    again = warnings_of(run_id)
    assert again[Drop.KEY_LIMIT][0] == warned[Drop.KEY_LIMIT][0], "one line per kind, rewritten in place"
    assert "dropped 22 metric points" in again[Drop.KEY_LIMIT][1]


def test_log_lines_are_cut_and_a_runs_log_volume_is_capped_and_said(
    ingest_run: tuple[redis.Redis, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from backend.limits import LOG_BYTES, Drop
    from backend.models import RunCounter

    client, run_id = ingest_run
    bounded(monkeypatch, max_log_line_bytes=1024, max_log_bytes_per_run=8192)
    stream = streams.run_stream(run_id)
    huge = "é" * 3000  # 6,000 bytes of two-byte characters: the cut never splits one
    lines = [[0, 1.0, huge], [0, 2.0, "short"]] + [[1, 3.0 + i, "y" * 1000] for i in range(10)]
    # "cut": lines the worker already cut as it read them (it never sends one longer than the cap)
    entry = streams.encode(streams.LOGS, {"attempt": 1, "lines": lines, "cut": 1})
    client.xadd(stream, entry)
    client.xadd(stream, entry)  # the same lines again (a new entry id): past the volume, all dropped
    drain(Ingest(client))

    with transaction() as session:
        texts = session.scalars(
            select(LogLine.text).where(LogLine.run_id == run_id, LogLine.entry_id.not_like("limit:%"))
            .order_by(LogLine.id)
        ).all()  # fmt: skip
        used = session.scalar(select(RunCounter.value).where(RunCounter.run_id == run_id, RunCounter.name == LOG_BYTES))
    assert texts[0] == "é" * 498 + " … [truncated 5004 bytes]" and texts[1] == "short"  # 1,023 bytes with its note
    assert len(texts) == 9, "7 lines of 1,000 bytes fit after the cut one and 'short'"
    assert used == sum(len(t.encode()) for t in texts) <= 8192
    warned = warnings_of(run_id)
    assert warned[Drop.LONG_LINE][1].endswith("cut 4 log lines longer than 1,024 bytes (TORCHYARD_MAX_LOG_LINE_BYTES)")
    assert "dropped 15 log lines past this run's log limit of 8,192 bytes" in warned[Drop.LOG_VOLUME][1]
