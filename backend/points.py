"""Metric points of one ingest batch, kept as columns, and their write path (README "Ingest").

Exactly once, per stream entry: an entry's points are written in one transaction, so they are all
stored or none are. A batch asks once which of its entries are stored already (a redelivery,
``ix_metrics_entry_pos``) and leaves them out; the rest go in as plain inserts inside a savepoint,
with nothing read back: SQLite multi-row VALUES through the driver's cursor (1.5-2x the rows/s
of executemany here), PostgreSQL one binary COPY (2-3x INSERT ... SELECT from unnest or from a
COPY-filled staging table with ON CONFLICT, measured here). Every point written is then known, so
rollups and alerts come from the columns. The unique key still decides: when a point is stored
already (the SDK resent points in a new entry after a lost reply; another ingest wrote the same
entry at the same moment), the insert fails, the savepoint is rolled back and the batch goes the
careful way: ``INSERT ... ON CONFLICT DO NOTHING RETURNING``, rollups from what came back."""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import psycopg
from sqlalchemy import BigInteger, Integer, Table, text
from sqlalchemy.orm import Session

from backend import alerts, bulk, limits, rollups
from backend.models import Metric

NAMES = ("run_id", "attempt", "rank", "step", "key", "value", "ts", "entry_pos")  # a row's columns, in this order
_TABLE: Table = Metric.__table__  # type: ignore[assignment]


@dataclass
class Segment:
    """One key's points of one stream entry: every column but step, value and ts is the same."""

    run_id: int
    attempt: int
    rank: int
    key: str
    pos: int | None  # the entry's position (streams.entry_position)
    steps: list[int]
    times: list[float]
    values: list[Any]  # numbers or None; NaN and None are stored as NULL
    order: list[int] | range  # each point's place among the batch's rows as the entries carried them


class Points:
    """A batch's metric points: :meth:`add` each entry's, :meth:`bound` them, :meth:`write`."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.carried = 0  # rows added so far

    def add(self, run_id: int, attempt: int, rank: int, pos: int | None, points: list[Any]) -> list[int]:
        """Adds an entry's ``[step, ts, {key: value}]`` points; returns their steps. One column per
        key, built by comprehensions (no object per point): an entry holds up to 10,000 points."""
        steps = [point[0] for point in points]
        times = [point[1] for point in points]
        dicts = [point[2] for point in points]
        if not dicts:
            return steps
        base, width = self.carried, len(dicts[0])
        try:  # the usual entry: every point has the keys of the first (one log() call, many steps)
            if sum(map(len, dicts)) != width * len(dicts):
                raise KeyError
            columns = {key: [d[key] for d in dicts] for key in dicts[0]}
            self.segments.extend(
                Segment(
                    run_id,
                    attempt,
                    rank,
                    key,
                    pos,
                    steps,
                    times,
                    values,
                    range(base + i, base + width * len(dicts), width),
                )
                for i, (key, values) in enumerate(columns.items())
            )
            self.carried += width * len(dicts)
        except KeyError:
            ragged: dict[str, Segment] = {}
            for step, ts, values in points:
                for key, value in values.items():
                    if (segment := ragged.get(key)) is None:
                        segment = ragged[key] = Segment(run_id, attempt, rank, key, pos, [], [], [], [])
                    segment.steps.append(step)
                    segment.times.append(ts)
                    segment.values.append(value)
                    cast(list[int], segment.order).append(self.carried)
                    self.carried += 1
            self.segments.extend(ragged.values())
        return steps

    def keys(self) -> dict[int, set[str]]:
        """Each run's keys in this batch."""
        keys: dict[int, set[str]] = {}
        for s in self.segments:
            keys.setdefault(s.run_id, set()).add(s.key)
        return keys

    def bound(self, bounds: limits.Bounds) -> None:
        """Drops (and counts) the points of keys past their runs' bounds."""
        allowed = bounds.metric_keys(self.keys())
        kept = []
        for s in self.segments:
            if s.key in allowed[s.run_id]:
                kept.append(s)
            else:
                bounds.drop_points(s.run_id, s.key, len(s.steps), s.attempt)
        self.segments = kept

    def write(self, session: Session, watch: alerts.Alerts | None = None) -> int:
        """Stores the points not stored yet, merges their rollups, passes them by ``watch``;
        returns how many were new."""
        fresh = self._not_stored(session)
        if not fresh:
            return 0
        columns = _Columns(fresh)
        if _insert(session, columns):
            new = len(columns.steps)
            blocks = rollups.blocks(columns.series, columns.series_ids, columns.steps, columns.values, columns.times)
            watched = [
                (s.run_id, s.attempt, s.key, s.rank, step, value, ts)
                for s in fresh
                if s.rank == 0 and s.key in alerts.WATCHED
                for step, ts, value in zip(s.steps, s.times, s.values, strict=True)
                if value is not None and value == value  # NaN is stored as NULL
            ]
        else:
            inserted = _insert_returning(session, columns)
            new, blocks, watched = len(inserted), rollups.accumulate(inserted), inserted
        rollups.merge(session, blocks)
        if watch is not None:
            watch.check(session, watched)
        return new

    def _not_stored(self, session: Session) -> list[Segment]:
        """The segments whose entries have no point stored: one query a run per batch."""
        positions: dict[int, set[int]] = {}
        for s in self.segments:
            if s.pos is not None:
                positions.setdefault(s.run_id, set()).add(s.pos)
        stored: set[tuple[int, int]] = set()
        for run_id, wanted in positions.items():
            marks = ", ".join(f"({int(p)})" for p in sorted(wanted))  # ints: nothing to escape
            found = session.execute(
                text(
                    f"WITH wanted(pos) AS (VALUES {marks}) SELECT pos FROM wanted WHERE EXISTS "
                    "(SELECT 1 FROM metrics WHERE run_id = :run_id AND entry_pos = wanted.pos)"
                ),
                {"run_id": run_id},
            )
            stored.update((run_id, pos) for (pos,) in found)
        return [s for s in self.segments if (s.run_id, s.pos) not in stored]


class _Columns:
    """The segments' rows as numpy columns, in the order the entries carried them: a replay reads
    an entry's rows back in insertion order (``backend/replay.py``), one point's keys together."""

    def __init__(self, segments: list[Segment]) -> None:
        lengths = np.array([len(s.steps) for s in segments], np.int64)
        series_of: dict[tuple[int, int, str, int], int] = {}
        ids = [series_of.setdefault((s.run_id, s.attempt, s.key, s.rank), len(series_of)) for s in segments]
        self.series = list(series_of)  # (run, attempt, key, rank) of each series id
        self.series_ids = np.repeat(np.array(ids, np.int64), lengths)
        self.run_ids = np.repeat(np.array([s.run_id for s in segments], np.int64), lengths)
        self.attempts = np.repeat(np.array([s.attempt for s in segments], np.int64), lengths)
        self.ranks = np.repeat(np.array([s.rank for s in segments], np.int64), lengths)
        key_of: dict[str, int] = {}
        self.key_ids = np.repeat(np.array([key_of.setdefault(s.key, len(key_of)) for s in segments], np.int64), lengths)
        self.key_names = list(key_of)
        # A platform-stream entry's id may be too large to place (pos None): -1 here, NULL stored.
        self.positions = np.repeat(np.array([-1 if s.pos is None else s.pos for s in segments], np.int64), lengths)
        chain = itertools.chain.from_iterable
        self.steps = np.fromiter(chain(s.steps for s in segments), np.int64, count=int(lengths.sum()))
        self.times = np.fromiter(chain(s.times for s in segments), np.float64, count=len(self.steps))
        # None becomes NaN: both are stored as NULL (SQLite cannot hold NaN), infinities are kept
        self.values = np.array(list(chain(s.values for s in segments)), np.float64)
        carried = np.argsort(np.fromiter(chain(s.order for s in segments), np.int64, count=len(self.steps)))
        for name in ("series_ids", "run_ids", "attempts", "ranks", "key_ids", "positions", "steps", "times", "values"):
            setattr(self, name, getattr(self, name)[carried])
        self.nulls = np.isnan(self.values)

    def table(self) -> np.ndarray:
        """The rows as Python values, a row of :data:`NAMES` each (NULL as None)."""
        table = np.empty((len(self.steps), len(NAMES)), object)
        for i, column in enumerate(
            (self.run_ids, self.attempts, self.ranks, self.steps, np.array(self.key_names, object)[self.key_ids],
             self.values, self.times, self.positions)
        ):  # fmt: skip
            table[:, i] = column
        table[self.nulls, NAMES.index("value")] = None
        table[self.positions < 0, NAMES.index("entry_pos")] = None
        return table


def _insert_returning(session: Session, columns: _Columns) -> list[rollups.NewRow]:
    """The careful way: inserts the rows not stored yet; returns those (:data:`rollups.COLUMNS`)."""
    rows = [dict(zip(NAMES, row, strict=True)) for row in columns.table().tolist()]
    return bulk.insert(session, _TABLE, rows, returning=rollups.COLUMNS)  # type: ignore[return-value]


def _insert(session: Session, columns: _Columns) -> bool:
    """Inserts every row, in a savepoint; False (and nothing inserted) if one is stored already."""
    driver: Any = session.connection().connection.driver_connection
    if session.get_bind().dialect.name == "postgresql":
        with driver.cursor() as cursor:
            cursor.execute("SAVEPOINT points")
            try:
                with cursor.copy(f"COPY metrics ({', '.join(NAMES)}) FROM STDIN (FORMAT BINARY)") as copy:
                    for data in _copy_binary(columns):
                        copy.write(data)
                written = True
            except psycopg.errors.IntegrityError:
                cursor.execute("ROLLBACK TO SAVEPOINT points")
                written = False
            cursor.execute("RELEASE SAVEPOINT points")
        return written
    cursor = driver.cursor()
    try:
        if not driver.in_transaction:  # pysqlite begins only at the first DML; a savepoint must be inside
            cursor.execute("BEGIN")
        cursor.execute("SAVEPOINT points")
        flat = columns.table().ravel().tolist()
        per = bulk.SQLITE_MAX_VARIABLES // len(NAMES)
        head = f"INSERT INTO metrics ({', '.join(NAMES)}) VALUES "
        mark = "(" + ", ".join("?" * len(NAMES)) + ")"
        full = head + ", ".join([mark] * per)
        try:
            for start in range(0, len(flat), per * len(NAMES)):
                chunk = flat[start : start + per * len(NAMES)]
                rows = len(chunk) // len(NAMES)
                cursor.execute(full if rows == per else head + ", ".join([mark] * rows), chunk)
            written = True
        except sqlite3.IntegrityError:
            cursor.execute("ROLLBACK TO points")
            written = False
        cursor.execute("RELEASE points")
        return written
    finally:
        cursor.close()


COPY_ROWS = 50_000  # rows laid out at once: bounds the memory a batch of long keys takes
_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # binary COPY: signature, flags, header extension length
_TRAILER = b"\xff\xff"


def _pg_type(name: str) -> str:
    """The binary COPY form of a non-key column: as wide as its type in the table (the model's)."""
    kind = _TABLE.c[name].type
    return ">i8" if isinstance(kind, BigInteger) else ">i4" if isinstance(kind, Integer) else ">f8"


_PG_TYPES = {name: _pg_type(name) for name in NAMES if name != "key"}


def _copy_binary(columns: _Columns) -> Iterator[bytes]:
    """The rows in PostgreSQL's binary COPY format (each field: its length, then its bytes), in
    order, built by numpy ``COPY_ROWS`` rows at a time: each row laid out at its widest (the
    chunk's longest key, value and position present), then the bytes a row does not have (the
    rest of a shorter key, a NULL's) masked out."""
    yield _SIGNATURE
    encoded = [k.encode() for k in columns.key_names]
    lengths = np.array([len(k) for k in encoded], np.int64)
    for start in range(0, len(columns.steps), COPY_ROWS):
        rows = slice(start, start + COPY_ROWS)
        key_ids = columns.key_ids[rows]
        key_lengths = lengths[key_ids]
        width = max(1, int(key_lengths.max()))
        fields: list[tuple[str, str]] = [("count", ">i2")]
        for name in NAMES:
            fields += [(f"{name}_length", ">i4"), (name, f"S{width}" if name == "key" else _PG_TYPES[name])]
        layout = np.dtype(fields)
        block = np.empty(len(key_ids), layout)
        block["count"] = len(NAMES)
        for name in NAMES:
            if name != "key":
                block[f"{name}_length"] = layout[name].itemsize
        block["run_id"], block["attempt"], block["rank"] = (
            columns.run_ids[rows],
            columns.attempts[rows],
            columns.ranks[rows],
        )
        block["step"], block["ts"], block["entry_pos"] = (
            columns.steps[rows],
            columns.times[rows],
            columns.positions[rows],
        )
        block["key"], block["key_length"] = np.array(encoded, f"S{width}")[key_ids], key_lengths
        block["value"] = columns.values[rows]
        nulls, no_pos = columns.nulls[rows], columns.positions[rows] < 0
        block["value_length"][nulls] = -1
        block["entry_pos_length"][no_pos] = -1
        keep = np.ones((len(block), layout.itemsize), bool)
        at = {name: layout.fields[name][1] for name in ("key", "value", "entry_pos")}  # type: ignore[index]  # offsets
        keep[:, at["key"] : at["key"] + width] = np.arange(width) < key_lengths[:, None]
        keep[:, at["value"] : at["value"] + 8] = ~nulls[:, None]
        keep[:, at["entry_pos"] : at["entry_pos"] + 8] = ~no_pos[:, None]
        yield block.view(np.uint8).reshape(len(block), layout.itemsize)[keep].tobytes()
    yield _TRAILER
