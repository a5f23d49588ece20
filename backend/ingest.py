"""Ingest: reads every active run stream with a consumer group and writes metrics, logs and
worker reports to the database in batches. Idempotent: metric and log rows have unique keys
and inserts skip duplicates, so a redelivered batch changes nothing; entries are acked only
after their transaction commits."""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

import redis
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from backend import bulk, lifecycle, rollups, runs
from backend.db import transaction
from backend.models import Attempt, LogLine, Metric, Run, StepProfile, utcnow
from torchyard import streams
from torchyard.settings import get_settings

log = logging.getLogger(__name__)
CLAIM_IDLE_MS = 30_000  # entries any other consumer held this long are taken over (a stuck one)
ALIVE_TTL_S = 5  # each consumer's liveness key; a consumer without one is dead: its entries are taken at once
BEAT_EVERY_S = 1.0  # the key's renewal
RETIRE_EVERY_S = 5.0
CLAIM_EVERY_S = 2.0
STREAM_TTL_S = 3600  # a finished run's stream stays this long for live viewers, then goes

Entry = tuple[str, str, dict[str, Any]]  # (stream, entry id, fields)
ROLLUP_COLUMNS = ("run_id", "key", "rank", "step", "value", "ts")


def apply_entries(session: Session, entries: Iterable[Entry]) -> int:
    """Writes the entries; returns how many metric points were new."""
    metric_rows: list[dict[str, Any]] = []
    log_rows: list[dict[str, Any]] = []
    profile_rows: list[dict[str, Any]] = []
    last_step: dict[int, int] = {}
    first_step: dict[tuple[int, int], int] = {}  # (run, attempt) → the smallest step in this batch
    reports: list[tuple[int, dict[str, Any]]] = []
    for stream, entry_id, fields in entries:
        run_id = streams.run_id_of(stream)
        entry_type, data = streams.decode(fields)
        if entry_type == streams.METRICS:
            attempt, rank = data["attempt"], data["rank"]
            if data["points"]:
                first = min(point[0] for point in data["points"])
                first_step[run_id, attempt] = min(first_step.get((run_id, attempt), first), first)
            for step, ts, values in data["points"]:
                last_step[run_id] = max(last_step.get(run_id, 0), step)
                metric_rows.extend(
                    {
                        "run_id": run_id,
                        "attempt": attempt,
                        "rank": rank,
                        "step": step,
                        "key": key,
                        "value": _finite_or_none(value),
                        "ts": ts,
                    }
                    for key, value in values.items()
                )
        elif entry_type == streams.LOGS:
            log_rows.extend(
                {
                    "run_id": run_id,
                    "entry_id": entry_id,
                    "seq": seq,
                    "attempt": data["attempt"],
                    "rank": rank,
                    "ts": ts,
                    "text": text,
                }
                for seq, (rank, ts, text) in enumerate(data["lines"])
            )
        elif entry_type == streams.PROFILE:
            profile_rows.append(
                {
                    "run_id": run_id,
                    "attempt": data["attempt"],
                    "rank": data["rank"],
                    "step": data["step"],
                    "timeline": json.dumps(data["timeline"], separators=(",", ":")),
                }
            )
        elif entry_type == streams.REPORT:
            reports.append((run_id, data))
        # STATE entries are for live readers: the database already has them.
    inserted = bulk.insert(session, Metric.__table__, metric_rows, returning=ROLLUP_COLUMNS)  # type: ignore[arg-type]
    rollups.merge(session, rollups.accumulate(inserted))  # type: ignore[arg-type]
    bulk.insert(session, LogLine.__table__, log_rows)  # type: ignore[arg-type]
    bulk.insert(session, StepProfile.__table__, profile_rows)  # type: ignore[arg-type]
    for run_id, step in last_step.items():
        # last_step_at is the run's pulse (the watchdog's stall clock): any step counts, replayed ones too.
        session.execute(update(Run).where(Run.id == run_id).values(last_step_at=utcnow()))
        session.execute(update(Run).where(Run.id == run_id, Run.last_step < step).values(last_step=step))
    for (run_id, number), step in first_step.items():
        session.execute(
            update(Attempt)
            .where(Attempt.run_id == run_id, Attempt.number == number)
            .where(or_(Attempt.first_step.is_(None), Attempt.first_step > step))
            .values(first_step=step)
        )
    for run_id, data in reports:
        apply_report(session, run_id, data)
    return len(inserted)


def apply_report(session: Session, run_id: int, data: dict[str, Any]) -> None:
    """A worker's word on its node's share of an attempt: it started, or it exited and how. An
    attempt succeeds when every node of its gang succeeded; the first share to end otherwise
    ends the attempt (and, once committed, the rest of the gang)."""
    run = session.get(Run, run_id)
    attempt = session.scalar(select(Attempt).where(Attempt.run_id == run_id, Attempt.number == data["attempt"]))
    if run is None or attempt is None:
        return
    share = next((a for a in attempt.allocations if a.node_id == data["node"]), None)
    if data["event"] == "started":
        if share is not None and share.started_at is None:
            share.started_at = utcnow()
        if attempt.ended_at is not None:
            return  # a late node of a gang that already ended: the end key stops it
        if attempt.started_at is None:
            attempt.status, attempt.started_at = lifecycle.RUNNING, utcnow()
        if run.status == lifecycle.SCHEDULED:
            lifecycle.transition(session, run, lifecycle.RUNNING, f"started on {data['node']}")
        return
    if share is not None and share.ended_at is None:
        share.exit_status, share.ended_at = data["status"], utcnow()  # its node's slots are free again
    if attempt.ended_at is not None:
        return  # already settled (a redelivered report, or a gang member ending after the first)
    to = data["status"]
    if to == lifecycle.SUCCEEDED and any(a.ended_at is None for a in attempt.allocations):
        return  # the rest of the gang is still finishing
    lifecycle.end_attempt(session, attempt, to, data.get("returncode"))
    if data.get("retryable") and to == lifecycle.FAILED:
        runs.fail_or_restart(session, run, data.get("reason") or f"attempt {data['attempt']} lost its node")
        return
    if run.status == lifecycle.CANCELLING and to == lifecycle.FAILED:
        to = lifecycle.CANCELLED  # a rank killed by our own SIGTERM is a cancel, not a failure
    if lifecycle.can_transition(run, to):
        lifecycle.transition(session, run, to, data.get("reason") or f"attempt {data['attempt']} {to}")
    else:
        log.warning("run %s is %s; ignoring its attempt's exit as %s", run_id, run.status, to)


def _finite_or_none(value: Any) -> float | None:
    """NaN is stored as NULL (SQLite cannot hold NaN); infinities are kept."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


class Ingest:
    def __init__(
        self,
        client: redis.Redis,
        consumer: str | None = None,
        batch: int | None = None,
        claim_idle_ms: int = CLAIM_IDLE_MS,
    ) -> None:
        self.client = client
        self.claim_idle_ms = claim_idle_ms
        self.consumer = consumer or f"{socket.gethostname()}-{id(self):x}"
        self.batch = batch or get_settings().ingest_batch
        self._grouped: set[str] = set()
        self._last_retire = 0.0
        self._last_claim = 0.0
        self._last_beat = 0.0

    def _active(self) -> list[str]:
        members: Any = self.client.smembers(streams.ACTIVE_STREAMS)
        keys = sorted(k.decode() for k in members)
        for key in keys:
            if key not in self._grouped:
                try:
                    self.client.xgroup_create(key, streams.INGEST_GROUP, id="0", mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                self._grouped.add(key)
        return keys

    def poll(self, block_ms: int = 1000) -> int:
        """One batch: read (own pending first, then idle entries of dead consumers, then new),
        write, commit, ack. Returns the number of entries handled."""
        if time.monotonic() - self._last_beat >= BEAT_EVERY_S:
            self.heartbeat()
        keys = self._active()
        if not keys:
            time.sleep(block_ms / 1000)
            return 0
        entries = self._read(keys, "0", None) or self._claim_due(keys) or self._read(keys, ">", block_ms)
        if entries:
            try:
                with transaction() as session:
                    written = apply_entries(session, entries)
            except (redis.RedisError, OSError):
                raise
            except Exception:
                log.exception("ingest batch of %d entries failed; retrying them one by one", len(entries))
                written = self._apply_one_by_one(entries)
            self._ack(entries, written)
        if time.monotonic() - self._last_retire > RETIRE_EVERY_S:
            self._retire_finished(keys)
        return len(entries)

    def _apply_one_by_one(self, entries: list[Entry]) -> int:
        """Isolates a malformed entry so it cannot block the stream: it is logged and skipped."""
        written = 0
        for entry in entries:
            try:
                with transaction() as session:
                    written += apply_entries(session, [entry])
            except Exception:
                log.exception("skipping malformed entry %s of %s: %r", entry[1], entry[0], entry[2])
        return written

    def _ack(self, entries: list[Entry], points_written: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        for stream, entry_id, _ in entries:
            pipe.xack(stream, streams.INGEST_GROUP, entry_id)
        pipe.incrby(streams.INGESTED_POINTS, points_written)  # for /metrics
        pipe.execute()

    def _read(self, keys: list[str], start: str, block_ms: int | None) -> list[Entry]:
        try:
            result: Any = self.client.xreadgroup(
                streams.INGEST_GROUP, self.consumer, {k: start for k in keys}, count=self.batch, block=block_ms
            )
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):  # Redis restarted without the stream: make the group again
                self._grouped.clear()
                return []
            raise
        return [(s.decode(), i.decode(), f) for s, items in result or [] for i, f in items if f]

    def _claim_due(self, keys: list[str]) -> list[Entry]:
        """Takes over dead consumers' entries; every few seconds, not every batch."""
        if time.monotonic() - self._last_claim < CLAIM_EVERY_S:
            return []
        self._last_claim = time.monotonic()
        return self._claim(keys)

    def heartbeat(self) -> None:
        """This consumer is alive (for ``ALIVE_TTL_S``): its entries are its own."""
        self._last_beat = time.monotonic()
        self.client.set(streams.INGEST_CONSUMER_ALIVE + self.consumer, 1, ex=ALIVE_TTL_S)

    def _claim(self, keys: list[str]) -> list[Entry]:
        """A consumer whose liveness key has expired (an ingest killed mid-batch) held entries it
        will never ack: take them now, not after ``claim_idle_ms``, and forget the consumer. Any
        entry held that long by anyone (a stuck consumer) is taken too."""
        claimed: list[Entry] = []
        group = streams.INGEST_GROUP
        for key in keys:
            for consumer in self.client.xinfo_consumers(key, group):
                name = consumer["name"].decode()
                if name == self.consumer or self.client.exists(streams.INGEST_CONSUMER_ALIVE + name):
                    continue
                held = self.client.xpending_range(key, group, "-", "+", self.batch, consumername=name)
                if held:
                    taken: Any = self.client.xclaim(key, group, self.consumer, 0, [h["message_id"] for h in held])
                    claimed.extend((key, i.decode(), f) for i, f in taken if f)
                if len(held) < self.batch:  # all taken: the dead consumer goes from the group
                    self.client.xgroup_delconsumer(key, group, name)
            _next, items, *_ = self.client.xautoclaim(
                key, group, self.consumer, self.claim_idle_ms, "0-0", count=self.batch
            )
            claimed.extend((key, i.decode(), f) for i, f in items if f)
        return claimed

    def _retire_finished(self, keys: list[str]) -> None:
        """A finished run whose stream is fully ingested leaves the active set; its stream
        expires later."""
        self._last_retire = time.monotonic()
        run_ids = [streams.run_id_of(k) for k in keys]
        with transaction() as session:
            finished = set(
                session.scalars(select(Run.id).where(Run.id.in_(run_ids), Run.status.in_(lifecycle.TERMINAL)))
            )
        for key in keys:
            if streams.run_id_of(key) not in finished:
                continue
            groups = {g["name"].decode(): g for g in self.client.xinfo_groups(key)}
            group = groups.get(streams.INGEST_GROUP)
            if group and group["pending"] == 0 and group.get("lag") == 0:
                self.client.srem(streams.ACTIVE_STREAMS, key)
                self.client.expire(key, STREAM_TTL_S)
                self._grouped.discard(key)

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.poll()
            except (redis.RedisError, OSError) as exc:
                log.warning("ingest: Redis unavailable (%s); retrying", exc)
                stop.wait(1.0)
            except Exception:
                log.exception("ingest batch failed; it stays pending and is retried")
                stop.wait(1.0)


def serve(stop: threading.Event | None = None) -> None:
    client = redis.Redis.from_url(get_settings().redis_url, socket_timeout=30)
    lifecycle.set_publisher(client)
    Ingest(client).serve(stop or threading.Event())
