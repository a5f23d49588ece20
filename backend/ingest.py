"""Ingest: reads every active run stream with a consumer group and writes metrics, logs and
profiles to the database in batches; worker reports go to ``backend/attempts.py``, which decides
what they mean for the run, and the ranks' hang dumps to ``backend/diagnoses.py``; new points pass
the live alerts (``backend/alerts.py``: a run slower than it was). Idempotent: metric and log rows have unique keys
and inserts skip duplicates, so a redelivered batch changes nothing; entries are acked only
after their transaction commits.

Trust (README "Walls"): a run's rank stream (``ty:run:<id>:in``) is written by user code, so each
of its entries is screened (:func:`screen_rank_entry`): only ``metrics``/``profile``/``facts``, for the
run's current attempt and a rank below its world size, within ``streams.RANK_LIMITS``. Anything
else is dropped, acked and counted in ``ty:stats:rejected`` (by reason). The active set is checked
too: a member that is not a run stream, or a key of another type, is removed and counted, never
read (one WRONGTYPE key would otherwise fail every read of every stream).

Bounds (README "Limits"): every second, each stream written since is trimmed behind what is
committed, keeping the last ``TORCHYARD_STREAM_KEEP_S`` seconds (``backend/trim.py``); each stored
row carries its entry's position, and reports and state changes are kept too (``StreamEntry``), so
a live view behind the trim replays the entries it missed from here (``backend/replay.py``)."""

from __future__ import annotations

import gc
import json
import logging
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from backend import alerts, attempts, bulk, diagnoses, lifecycle, limits, points, screening
from backend.db import transaction
from backend.models import Allocation, Attempt, LogLine, Run, StepProfile, StreamEntry, utcnow
from backend.trim import TRIM_EVERY_S, Trimmer, ingested
from torchyard import streams
from torchyard.settings import get_settings
from torchyard.states import TERMINAL

log = logging.getLogger(__name__)
CLAIM_IDLE_MS = 30_000  # entries any other consumer held this long are taken over (a stuck one)
ALIVE_TTL_S = 5  # each consumer's liveness key; a consumer without one is dead: its entries are taken at once
BEAT_EVERY_S = 1.0  # the key's renewal
RETIRE_EVERY_S = 5.0
CLAIM_EVERY_S = 2.0
PROGRESS_EVERY_S = 1.0  # how often a run's live viewers hear how far behind storage is
BATCH_POINTS = 200_000  # metric points a batch aims at: a backlog read 500 entries of 20,000 at once (GBs)
# What a batch reads at most, encoded, past its first read (~20 bytes a point: about BATCH_POINTS).
BATCH_BYTES = 4 << 20
STREAM_TTL_S = 3600  # a finished run's stream (its last seconds) and trim mark stay this long, then go

Entry = tuple[str, str, dict[str, Any]]  # (stream, entry id, fields)


@dataclass
class Progress:
    """What a batch tells a run's live viewers (``streams.ingested_key``): its oldest metrics entry
    (Redis ms) and each rank's running count of points its SDK dropped, in the newest attempt seen."""

    oldest_ms: int
    attempt: int = 0
    sdk_dropped: dict[int, int] = field(default_factory=dict)

    def add(self, entry_ms: int, attempt: int, rank: int, dropped: int) -> None:
        self.oldest_ms = min(self.oldest_ms, entry_ms)
        if attempt > self.attempt:
            self.attempt, self.sdk_dropped = attempt, {}
        if attempt == self.attempt:
            self.sdk_dropped[rank] = max(self.sdk_dropped.get(rank, 0), dropped)


@dataclass
class Told:
    """What ingest last told a run's live viewers: when, and each rank's SDK drops in ``attempt``."""

    attempt: int
    at: float = -math.inf
    sdk_dropped: dict[int, int] = field(default_factory=dict)


def apply_entries(
    session: Session,
    entries: Iterable[Entry],
    rejected: Counter[str] | None = None,
    progress: dict[int, Progress] | None = None,
    watch: alerts.Alerts | None = None,
) -> int:
    """Writes the entries, within the runs' bounds (``backend.limits``); returns how many metric
    points were new. Rank-stream entries that fail :func:`screen_rank_entry` are skipped and
    counted in ``rejected``; each run's metrics entries are summed up in ``progress``; ``watch``:
    the new points go past the live alerts too."""
    metric_points = points.Points()
    log_rows: list[dict[str, Any]] = []
    profile_rows: list[dict[str, Any]] = []
    kept_rows: list[dict[str, Any]] = []  # reports and state changes, for replays (StreamEntry)
    last_step: dict[int, int] = {}
    first_step: dict[tuple[int, int], int] = {}  # (run, attempt) → the smallest step in this batch
    reports: list[tuple[int, dict[str, Any]]] = []
    worker_cut: Counter[tuple[int, int]] = Counter()  # (run, attempt) → log lines the worker cut
    entries = list(entries)
    current = screening.current_attempts(session, {streams.run_id_of(s) for s, _, _ in entries if s.endswith(":in")})
    for stream, entry_id, fields in entries:
        run_id, from_ranks = streams.parse_stream(stream) or (0, True)
        pos = streams.entry_position(entry_id, from_ranks)  # every stored row carries it
        if from_ranks and pos is None:
            _note_rejected(rejected, stream, entry_id, "id")  # an explicit id no row can carry
            continue
        if from_ranks:
            entry_type, data, why = screening.screen_rank_entry(fields, current.get(run_id))
            if why:
                _note_rejected(rejected, stream, entry_id, why)
                continue
        else:
            entry_type, data = streams.decode(fields)
        if entry_type == streams.METRICS:
            attempt, rank = data["attempt"], data["rank"]
            if progress is not None:
                entry_ms = int(entry_id.split("-")[0])
                progress.setdefault(run_id, Progress(entry_ms)).add(entry_ms, attempt, rank, data.get("dropped", 0))
            if steps := metric_points.add(run_id, attempt, rank, pos, data["points"]):
                first, last = min(steps), max(steps)
                first_step[run_id, attempt] = min(first_step.get((run_id, attempt), first), first)
                last_step[run_id] = max(last_step.get(run_id, 0), last)
        elif entry_type == streams.LOGS:
            worker_cut[run_id, data["attempt"]] += data.get("cut", 0)
            log_rows.extend(
                {
                    "run_id": run_id,
                    "entry_id": entry_id,
                    "seq": seq,
                    "attempt": data["attempt"],
                    "rank": rank,
                    "ts": ts,
                    "text": text,
                    "entry_pos": pos,
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
                    "entry_pos": pos,
                }
            )
        elif entry_type == streams.REPORT:
            reports.append((run_id, data))
        elif entry_type == streams.FACTS:
            attempts.record_facts(session, run_id, data["attempt"], data["facts"])
        elif entry_type == streams.DIAGNOSIS:
            diagnoses.record_answer(session, run_id, data)
        if entry_type in (streams.REPORT, streams.STATE) and pos is not None:
            kept_rows.append({"run_id": run_id, "entry_pos": pos, "type": entry_type, "data": json.dumps(data)})
    bounds = limits.Bounds(session, get_settings(), metric_points.keys(), {row["run_id"] for row in log_rows})
    metric_points.bound(bounds)
    log_rows = bounds.logs(log_rows, worker_cut)
    written = metric_points.write(session, watch)
    new_lines = bulk.insert(session, LogLine.__table__, log_rows, returning=("run_id", "entry_id", "seq"))  # type: ignore[arg-type]
    bounds.stored_logs(new_lines)
    bounds.record()
    bulk.insert(session, StepProfile.__table__, profile_rows)  # type: ignore[arg-type]
    bulk.insert(session, StreamEntry.__table__, kept_rows)  # type: ignore[arg-type]
    # Rows every batch of a run updates, in one order everywhere: two ingest processes write one
    # run's batches side by side (limits.Bounds), and would deadlock taking them in opposite orders.
    for run_id, step in sorted(last_step.items()):
        # last_step_at is the run's pulse (the watchdog's stall clock): any step counts, replayed ones too.
        session.execute(update(Run).where(Run.id == run_id).values(last_step_at=utcnow()))
        session.execute(update(Run).where(Run.id == run_id, Run.last_step < step).values(last_step=step))
    for (run_id, number), step in sorted(first_step.items()):
        session.execute(
            update(Attempt)
            .where(Attempt.run_id == run_id, Attempt.number == number)
            .where(or_(Attempt.first_step.is_(None), Attempt.first_step > step))
            .values(first_step=step)
        )
    for run_id, data in reports:
        attempts.apply_report(session, run_id, data)  # what a report means is attempts.py's call
    return written


def _encoded_size(entries: list[Entry]) -> int:
    return sum(len(value) for _, _, fields in entries for value in fields.values())


_rejected_logged = 0


def _note_rejected(rejected: Counter[str] | None, stream: str, entry_id: str, why: str) -> None:
    global _rejected_logged
    if rejected is not None:
        rejected[why] += 1
    _rejected_logged += 1
    if _rejected_logged <= 20 or _rejected_logged % 1000 == 0:  # a flood of them must not flood the log
        log.warning("dropped entry %s of %s from the ranks: %s (%d so far)", entry_id, stream, why, _rejected_logged)


@contextmanager
def _no_gc() -> Iterator[None]:
    """No cyclic collection during a batch: its decoded JSON (a list and a dict per point, freed
    by reference counting at the end) made collections take a fifth of ingest's time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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
        self.reading = self.batch  # entries the next read asks for: fewer when entries are large
        self.trimmer = Trimmer(client, get_settings().stream_keep_s)
        self.alerts = alerts.Alerts(get_settings())
        self._grouped: set[str] = set()
        self._written: set[str] = set()  # streams to trim: entries acked since the last trim, or kept by the window
        self._last_trim = 0.0
        self._last_retire = 0.0
        self._last_claim = 0.0
        self._last_beat = 0.0
        self.progress_every_s = PROGRESS_EVERY_S
        self._told: dict[int, Told] = {}  # what each run's live viewers were last told

    def _active(self) -> list[str]:
        """The active set's run streams, each with the ingest group. Members that are not run
        streams, and keys that exist as another type, are removed from the set and counted."""
        members: Any = self.client.smembers(streams.ACTIVE_STREAMS)
        keys = sorted(k.decode(errors="replace") for k in members)
        new = [k for k in keys if k not in self._grouped]
        if new:
            pipe = self.client.pipeline(transaction=False)
            for key in new:
                pipe.type(key)
            kinds = pipe.execute()
            for key, kind in zip(new, kinds, strict=True):
                kind = kind.decode() if isinstance(kind, bytes) else str(kind)
                if streams.parse_stream(key) is None or kind not in ("stream", "none"):
                    self._refuse_member(key, "active-not-a-stream")
                    continue
                try:
                    self.client.xgroup_create(key, streams.INGEST_GROUP, id="0", mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        self._refuse_member(key, "active-not-a-stream")  # e.g. replaced by a string just now
                        continue
                self._grouped.add(key)
        return [k for k in keys if k in self._grouped]

    def _refuse_member(self, key: str, why: str) -> None:
        log.warning("ignoring %r in %s: %s", key, streams.ACTIVE_STREAMS, why)
        pipe = self.client.pipeline(transaction=False)
        pipe.srem(streams.ACTIVE_STREAMS, key)
        pipe.hincrby(streams.REJECTED, why, 1)
        pipe.execute()

    def poll(self, block_ms: int = 1000) -> int:
        """One batch: read (own pending first, then idle entries of dead consumers, then new),
        write, commit, ack. Returns the number of entries handled."""
        if time.monotonic() - self._last_beat >= BEAT_EVERY_S:
            self.heartbeat()
        keys = self._active()
        if not keys:
            time.sleep(block_ms / 1000)
            return 0
        entries = self._read(keys, "0", None) or self._claim_due(keys) or self._read_new(keys, block_ms)
        if entries:
            rejected: Counter[str] = Counter()
            progress: dict[int, Progress] = {}
            watched = self.alerts.snapshot()
            try:
                with transaction() as session, _no_gc():
                    written = apply_entries(session, entries, rejected, progress, watch=self.alerts)
            except (redis.RedisError, OSError):
                self.alerts.restore(watched)
                raise
            except Exception:
                log.exception("ingest batch of %d entries failed; retrying them one by one", len(entries))
                self.alerts.restore(watched)
                rejected.clear()
                written = self._apply_one_by_one(entries, rejected)
            self._ack(entries, written, rejected)
            if written:
                self.reading = max(1, min(self.batch, BATCH_POINTS * len(entries) // written))
            self._written.update(stream for stream, _, _ in entries)
            self._tell_viewers(progress)
        if self._written and time.monotonic() - self._last_trim >= TRIM_EVERY_S:
            self.trim()
        if time.monotonic() - self._last_retire > RETIRE_EVERY_S:
            self._retire_finished(keys)
        return len(entries)

    def _tell_viewers(self, progress: dict[int, Progress]) -> None:
        """Tells each run's live viewers how far behind its ranks storage is and what each rank's SDK
        dropped (``streams.ingested_key``): at most once every ``progress_every_s`` a run, at once when
        a rank's drop count grew."""
        now = time.monotonic()
        due: list[tuple[int, float, Told]] = []
        for run_id, p in progress.items():
            told = self._told.get(run_id)
            if told is None or p.attempt > told.attempt:
                told = self._told[run_id] = Told(attempt=p.attempt)
            elif p.attempt < told.attempt:
                continue  # a late batch of an attempt already replaced
            grew = any(n > told.sdk_dropped.get(rank, 0) for rank, n in p.sdk_dropped.items())
            told.sdk_dropped.update(p.sdk_dropped)
            if grew or now - told.at >= self.progress_every_s:
                told.at = now
                due.append((run_id, p.oldest_ms, told))
        if not due:
            return
        seconds, micros = self.client.time()  # the clock the entry ids were made with
        clock_ms = seconds * 1000 + micros // 1000
        pipe = self.client.pipeline(transaction=False)
        for run_id, oldest_ms, told in due:
            event = {
                "lag_s": round(max(0, clock_ms - oldest_ms) / 1000, 3),
                "sdk_dropped": {str(rank): n for rank, n in sorted(told.sdk_dropped.items())},
            }
            pipe.set(streams.ingested_key(run_id), json.dumps(event), ex=streams.INGESTED_TTL_S)
        pipe.execute()
        if len(self._told) > 1000:  # bounded: runs that went quiet drop out
            self._told = {run_id: t for run_id, t in self._told.items() if now - t.at < 60}

    def trim(self) -> None:
        """Trims the streams written since the last trim behind what is committed (backend/trim.py),
        and again later those whose committed entries are still inside the viewers' window."""
        self._last_trim = time.monotonic()
        written, self._written = self._written, set()
        self._written |= self.trimmer.trim(written)

    def _apply_one_by_one(self, entries: list[Entry], rejected: Counter[str]) -> int:
        """Isolates a malformed entry so it cannot block the stream: it is logged and skipped."""
        written = 0
        for entry in entries:
            watched = self.alerts.snapshot()
            try:
                with transaction() as session:
                    written += apply_entries(session, [entry], rejected, watch=self.alerts)
            except Exception:
                self.alerts.restore(watched)
                log.exception("skipping malformed entry %s of %s: %.300r", entry[1], entry[0], entry[2])
                rejected["failed"] += 1
        return written

    def _ack(self, entries: list[Entry], points_written: int, rejected: Counter[str] | None = None) -> None:
        ids: dict[str, list[str]] = {}
        for stream, entry_id, _ in entries:
            ids.setdefault(stream, []).append(entry_id)
        pipe = self.client.pipeline(transaction=False)
        for stream, stream_ids in ids.items():
            pipe.xack(stream, streams.INGEST_GROUP, *stream_ids)
        pipe.incrby(streams.INGESTED_POINTS, points_written)  # for /metrics
        for why, n in (rejected or {}).items():
            pipe.hincrby(streams.REJECTED, why, n)
        pipe.execute()

    def _read(self, keys: list[str], start: str, block_ms: int | None) -> list[Entry]:
        try:
            result: Any = self.client.xreadgroup(
                streams.INGEST_GROUP, self.consumer, {k: start for k in keys}, count=self.reading, block=block_ms
            )
        except redis.ResponseError as exc:
            # NOGROUP: Redis restarted without the stream (make the group again); WRONGTYPE: a key
            # was replaced by another type since it was checked (check every key again, drop it).
            if "NOGROUP" in str(exc) or "WRONGTYPE" in str(exc):
                self._grouped.clear()
                return []
            raise
        return [(s.decode(), i.decode(), f) for s, items in result or [] for i, f in items if f]

    def _read_new(self, keys: list[str], block_ms: int) -> list[Entry]:
        """New entries: a read that waits for them, then, while the streams hold a backlog, more
        reads that do not wait, up to ``BATCH_BYTES``. A batch's fixed costs (its queries, the
        COPY's set-up, the commit) are then shared by enough points even when the SDK sends many
        small entries: PostgreSQL, 4 ranks paced at 100k points/s, went from 52k to 78k points/s."""
        entries = read = self._read(keys, ">", block_ms)
        size = _encoded_size(read)
        while len(read) >= self.reading and size < BATCH_BYTES:
            read = self._read(keys, ">", None)
            entries += read
            size += _encoded_size(read)
        return entries

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
        for key in keys:
            try:
                claimed.extend(self._claim_key(key))
            except redis.ResponseError as exc:  # the key changed type or lost its group since it was checked
                log.warning("ingest: cannot claim from %s (%s); checking it again", key, exc)
                self._grouped.discard(key)
        return claimed

    def _claim_key(self, key: str) -> list[Entry]:
        claimed: list[Entry] = []
        group = streams.INGEST_GROUP
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
        expires later. Not while a share of it still holds slots: its worker's exit report is
        still to come (a stalled or gang-ended attempt's exit arrives after the run's end)."""
        self._last_retire = time.monotonic()
        run_ids = sorted({streams.run_id_of(k) for k in keys})
        with transaction() as session:
            holding = select(Attempt.run_id).join(Allocation).where(Allocation.ended_at.is_(None))
            finished = set(
                session.scalars(
                    select(Run.id).where(Run.id.in_(run_ids), Run.status.in_(TERMINAL), Run.id.not_in(holding))
                )
            )
            self.alerts.forget(session, finished)
        for key in keys:
            if streams.run_id_of(key) not in finished:
                continue
            try:
                done = ingested(self.client, key)
            except redis.ResponseError:  # not a stream any more: checked again (and dropped) by _active
                self._grouped.discard(key)
                continue
            if done:
                pipe = self.client.pipeline(transaction=False)
                pipe.srem(streams.ACTIVE_STREAMS, key)
                pipe.expire(key, STREAM_TTL_S)
                pipe.expire(streams.trim_key(streams.run_id_of(key)), STREAM_TTL_S)
                pipe.execute()
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
