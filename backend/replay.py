"""What a live stream no longer holds, read back from the database: a run's stream entries between
two ids, as the stream carried them. Ingest trims each stream behind what it has committed
(``backend/trim.py``) and stores every row with its entry's position (``streams.entry_position``:
the entry's id and stream in one number), so a replay is the same entries with the same ids in the
same order as the live stream, and the live view (``backend/live.py``) moves from one to the other
with no gap and no repeat. What ingest refused or dropped (``backend/screening.py``,
``backend/limits.py``) is not in the database, so it is not replayed: the database is the truth.
Metrics entries come back without the SDK's ``dropped`` count, which is not stored."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from backend.models import LogLine, Metric, StepProfile, StreamEntry
from torchyard import streams

Entry = tuple[str, str, dict[str, Any]]  # (entry id, type, data)


@dataclass(frozen=True)
class Page:
    entries: list[Entry]  # in id order
    below: str  # every stored entry of the stream after the asked start and below this id is above


@dataclass(frozen=True)
class _Source:
    """One table's rows as stream entries: the columns to read (position first), the order of
    rows within an entry, the most rows one page reads, and how one entry's rows become its data."""

    model: type[Metric | LogLine | StepProfile | StreamEntry]
    columns: Sequence[InstrumentedAttribute[Any]]
    within: InstrumentedAttribute[Any]
    rows: int
    entry: Callable[[list[Any]], tuple[str, dict[str, Any]]]


def _metrics(rows: list[Any]) -> tuple[str, dict[str, Any]]:
    # One SDK log() call is one point: its keys were stored together, in a row each.
    points = [
        [step, ts, {row.key: row.value for row in group}]
        for (step, ts), group in itertools.groupby(rows, key=lambda row: (row.step, row.ts))
    ]
    return streams.METRICS, {"attempt": rows[0].attempt, "rank": rows[0].rank, "points": points}


def _logs(rows: list[Any]) -> tuple[str, dict[str, Any]]:
    return streams.LOGS, {"attempt": rows[0].attempt, "lines": [[row.rank, row.ts, row.text] for row in rows]}


def _profile(rows: list[Any]) -> tuple[str, dict[str, Any]]:
    row = rows[0]
    return streams.PROFILE, {
        "attempt": row.attempt,
        "rank": row.rank,
        "step": row.step,
        "timeline": json.loads(row.timeline),
    }


def _kept(rows: list[Any]) -> tuple[str, dict[str, Any]]:
    return rows[0].type, json.loads(rows[0].data)


M, L, P, K = Metric, LogLine, StepProfile, StreamEntry
SOURCES = (
    _Source(M, (M.entry_pos, M.attempt, M.rank, M.step, M.ts, M.key, M.value), M.id, 20_000, _metrics),
    _Source(L, (L.entry_pos, L.attempt, L.rank, L.ts, L.text), L.seq, 10_000, _logs),
    _Source(P, (P.entry_pos, P.attempt, P.rank, P.step, P.timeline), P.id, 16, _profile),  # a timeline: ≤ 2 MiB
    _Source(K, (K.entry_pos, K.type, K.data), K.id, 1_000, _kept),
)


def read(session: Session, run_id: int, from_ranks: bool, after: str, below: str) -> Page:
    """The stored entries of one of the run's streams with ``after < id < below``, in id order; a
    page of them when there are many (``Page.below`` says where it ends)."""
    first, last = streams.positions_between(after, below, from_ranks)
    entries: dict[int, tuple[str, dict[str, Any]]] = {}
    end = last + 2  # the page has every stored entry below this position (the stream's positions step by 2)
    for source in SOURCES:
        if first >= end:
            break
        rows, source_end = _page(session, source, run_id, first, end - 2)
        end = min(end, source_end)
        for pos, group in itertools.groupby(rows, key=lambda row: row[0]):
            entries[pos] = source.entry(list(group))
    ordered = [(streams.position_id(pos), *entries[pos]) for pos in sorted(entries) if pos < end]
    return Page(ordered, below if end > last else streams.position_id(end))


def _page(session: Session, source: _Source, run_id: int, first: int, last: int) -> tuple[list[Any], int]:
    """Whole entries of one table in positions ``first..last`` of one stream (the other stream's
    differ in the lowest bit), at most ``source.rows`` rows unless one entry alone has more; and
    the position below which the table's entries are all there."""
    pos = source.columns[0]
    query: Select[Any] = (
        select(*source.columns)
        .where(source.model.run_id == run_id, pos.between(first, last), pos % 2 == first % 2)
        .order_by(pos, source.within)
    )
    rows = list(session.execute(query.limit(source.rows)))
    if len(rows) < source.rows:
        return rows, last + 2
    cut = rows[-1][0]  # this entry's rows may go on past the limit
    whole = [row for row in rows if row[0] != cut]
    if whole:
        return whole, cut
    return list(session.execute(query.where(pos == cut))), cut + 2  # one entry larger than a page


def unplaced(session: Session, run_id: int) -> list[str]:
    """The kinds of the run's rows stored before rows carried positions (so no replay has them)."""
    kinds = []
    for name, model, extra in (
        ("metrics", Metric, ()),
        ("logs", LogLine, (LogLine.entry_id.not_like("limit:%"),)),  # the bounds' notes were never streamed
        ("profiles", StepProfile, ()),
    ):
        query = select(model.id).where(model.run_id == run_id, model.entry_pos.is_(None), *extra).limit(1)
        if session.scalar(query) is not None:
            kinds.append(name)
    return kinds
