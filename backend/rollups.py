"""Metric rollups: per rank, key and attempt, the extremes, sum and count of every block of
2**level steps at a few levels. Per attempt, because a resumed attempt logs again the steps after
its checkpoint: a block two attempts logged is read from the rows (the newest attempt's value per
step, as every other view shows), a block one attempt logged from its rollup. Kept by ingest from the rows it newly inserted; read by the metrics
endpoint when a chart asks for far fewer points than a range holds (a million steps drawn at
1,000 px reads ~1,000 rollup rows per rank instead of a million rows)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np
from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from backend import bulk
from backend.models import MetricRollup

LEVELS = (6, 8, 10, 12, 14, 16)  # blocks of 64 … 65,536 steps; each level 4x coarser
COLUMNS = ("run_id", "attempt", "key", "rank", "step", "value", "ts")  # of each newly inserted metric row
NewRow = tuple[int, int, str, int, int, float | None, float]


def accumulate(rows: Iterable[NewRow]) -> list[dict[str, Any]]:
    """The rollup rows that ``rows`` (newly inserted points) contribute, merged per block.
    Vectorised: a batch is thousands of points and this runs on ingest's hot path."""
    series: dict[tuple[int, int, str, int], list[tuple[int, float, float]]] = {}
    for run_id, attempt, key, rank, step, value, ts in rows:
        if value is not None and not math.isnan(value):  # NaN is a gap, not a value
            series.setdefault((run_id, attempt, key, rank), []).append((step, value, ts))
    blocks = []
    for (run_id, attempt, key, rank), points in series.items():
        arr = np.array(points, dtype=np.float64)
        steps, values, times = arr[:, 0].astype(np.int64), arr[:, 1], arr[:, 2]
        for level in LEVELS:
            bucket = steps >> level
            order = np.lexsort((values, bucket))  # by block, then by value within it
            sorted_buckets = bucket[order]
            starts = np.flatnonzero(np.r_[True, sorted_buckets[1:] != sorted_buckets[:-1]])
            ends = np.r_[starts[1:], len(order)]
            lows, highs = order[starts], order[ends - 1]
            sums = np.add.reduceat(values[order], starts)
            for i in range(len(starts)):
                lo, hi = lows[i], highs[i]
                blocks.append({
                    "run_id": run_id, "key": key, "level": level, "bucket": int(sorted_buckets[starts[i]]),
                    "rank": rank, "attempt": attempt, "min_step": int(steps[lo]), "min_value": float(values[lo]),
                    "min_ts": float(times[lo]), "max_step": int(steps[hi]), "max_value": float(values[hi]),
                    "max_ts": float(times[hi]), "sum": float(sums[i]), "count": int(ends[i] - starts[i]),
                })  # fmt: skip
    return blocks


def merge(session: Session, blocks: list[dict[str, Any]]) -> None:
    """Upserts blocks: extremes keep the more extreme side, sums and counts add up."""
    bulk.insert(session, cast(Table, MetricRollup.__table__), blocks, on_conflict=_MERGE)


def _keep(side: str, better: str) -> str:
    return ", ".join(
        f"{side}_{field} = CASE WHEN excluded.{side}_value {better} t.{side}_value "
        f"THEN excluded.{side}_{field} ELSE t.{side}_{field} END"
        for field in ("step", "ts", "value")  # every CASE reads the row as it was before this SET
    )


_MERGE = (
    "(run_id, key, level, bucket, rank, attempt) DO UPDATE SET "
    f"{_keep('min', '<')}, {_keep('max', '>')}, sum = t.sum + excluded.sum, count = t.count + excluded.count"
)


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
        .order_by(MetricRollup.bucket, MetricRollup.rank, MetricRollup.attempt)
    ).all()
