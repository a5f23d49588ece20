"""Metric rollups: per rank and key, the extremes, sum and count of every block of 2**level
steps at a few levels. Kept by ingest from the rows it newly inserted; read by the metrics
endpoint when a chart asks for far fewer points than a range holds (a million steps drawn at
1,000 px reads ~1,000 rollup rows per rank instead of a million rows)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import case, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from backend.models import MetricRollup

LEVELS = (6, 8, 10, 12, 14, 16)  # blocks of 64 … 65,536 steps; each level 4x coarser
NewRow = tuple[int, str, int, int, float | None, float]  # run_id, key, rank, step, value, ts


def accumulate(rows: Iterable[NewRow]) -> list[dict[str, Any]]:
    """The rollup rows that ``rows`` (newly inserted points) contribute, merged per block."""
    blocks: dict[tuple[int, str, int, int, int], dict[str, Any]] = {}
    for run_id, key, rank, step, value, ts in rows:
        if value is None or math.isnan(value):
            continue  # a gap, not a value
        for level in LEVELS:
            ident = (run_id, key, level, step >> level, rank)
            block = blocks.get(ident)
            if block is None:
                blocks[ident] = {
                    "run_id": run_id, "key": key, "level": level, "bucket": step >> level, "rank": rank,
                    "min_step": step, "min_value": value, "min_ts": ts,
                    "max_step": step, "max_value": value, "max_ts": ts, "sum": value, "count": 1,
                }  # fmt: skip
                continue
            if value < block["min_value"]:
                block["min_step"], block["min_value"], block["min_ts"] = step, value, ts
            if value > block["max_value"]:
                block["max_step"], block["max_value"], block["max_ts"] = step, value, ts
            block["sum"] += value
            block["count"] += 1
    return list(blocks.values())


def merge(session: Session, blocks: list[dict[str, Any]]) -> None:
    """Upserts blocks: extremes keep the more extreme side, sums and counts add up."""
    if not blocks:
        return
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    stmt = insert(MetricRollup)
    new, old = stmt.excluded, MetricRollup.__table__.c
    lower, higher = new.min_value < old.min_value, new.max_value > old.max_value
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "key", "level", "bucket", "rank"],
        set_={
            "min_step": case((lower, new.min_step), else_=old.min_step),
            "min_ts": case((lower, new.min_ts), else_=old.min_ts),
            "min_value": case((lower, new.min_value), else_=old.min_value),
            "max_step": case((higher, new.max_step), else_=old.max_step),
            "max_ts": case((higher, new.max_ts), else_=old.max_ts),
            "max_value": case((higher, new.max_value), else_=old.max_value),
            "sum": old.sum + new.sum,
            "count": old.count + new.count,
        },
    )
    session.execute(stmt, blocks)


def level_for(span: int, max_points: int) -> int:
    """The finest level whose blocks over ``span`` steps give at most ``max_points`` points
    (two per block: its minimum and its maximum)."""
    for level in LEVELS:
        if (span >> level) + 1 <= max_points // 2:
            return level
    return LEVELS[-1]


def read(session: Session, run_id: int, key: str, level: int, lo: int, hi: int) -> Sequence[MetricRollup]:
    return session.scalars(
        select(MetricRollup)
        .where(
            MetricRollup.run_id == run_id,
            MetricRollup.key == key,
            MetricRollup.level == level,
            MetricRollup.bucket >= lo >> level,
            MetricRollup.bucket <= hi >> level,
        )
        .order_by(MetricRollup.bucket, MetricRollup.rank)
    ).all()
