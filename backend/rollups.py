"""Metric rollups: per rank, key and attempt, the extremes, sum and count of every block of
2**level steps at a few levels. Per attempt, because a resumed attempt logs again the steps after
its checkpoint: a block two attempts logged is read from the rows (the newest attempt's value per
step, as every other view shows), a block one attempt logged from its rollup. Kept by ingest from the rows it newly inserted; read by the metrics
endpoint when a chart asks for far fewer points than a range holds (a million steps drawn at
1,000 px reads ~1,000 rollup rows per rank instead of a million rows)."""

from __future__ import annotations

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
    """The rollup rows that ``rows`` (newly inserted points, :data:`COLUMNS`) contribute."""
    series: dict[tuple[int, int, str, int], int] = {}
    ids, steps, values, times = [], [], [], []
    for run_id, attempt, key, rank, step, value, ts in rows:
        if value is not None:
            ids.append(series.setdefault((run_id, attempt, key, rank), len(series)))
            steps.append(step)
            values.append(value)
            times.append(ts)
    return blocks(list(series), np.array(ids, np.int64), np.array(steps, np.int64), np.array(values), np.array(times))


def blocks(
    series: list[tuple[int, int, str, int]], ids: np.ndarray, steps: np.ndarray, values: np.ndarray, times: np.ndarray
) -> list[dict[str, Any]]:
    """The rollup rows that new points contribute, merged per block: point i is ``steps[i]``,
    ``values[i]`` (NaN: a gap, not a value), ``times[i]`` of ``series[ids[i]]`` (run, attempt, key,
    rank). Columnar and vectorised: a batch is hundreds of thousands of points on ingest's hot path.
    Sorted once by series and step, every block of every level is a contiguous run; each level is
    reduced from the one below it (4x fewer rows each time), not from the points. Of equal extremes
    the earliest step is the minimum's, the latest the maximum's."""
    keep = ~np.isnan(values)
    ids, steps, values, times = ids[keep], steps[keep], values[keep], times[keep]
    order = np.lexsort((steps, ids))
    ids, steps, values, times = ids[order], steps[order], values[order], times[order]
    # One row per point to start: its own extremes, sum and count.
    lo = hi = (values, steps, times)
    sums, counts = values, np.ones(len(values), np.int64)
    buckets, shift, out = steps, 0, []
    for level in LEVELS:
        buckets = buckets >> (level - shift)
        shift = level
        if not len(ids):
            break
        starts = np.flatnonzero(np.r_[True, (ids[1:] != ids[:-1]) | (buckets[1:] != buckets[:-1])])
        lo, hi = _pick(lo, starts, np.minimum, first=True), _pick(hi, starts, np.maximum, first=False)
        sums, counts = np.add.reduceat(sums, starts), np.add.reduceat(counts, starts)
        ids, buckets = ids[starts], buckets[starts]
        for i, (sid, bucket, count) in enumerate(zip(ids.tolist(), buckets.tolist(), counts.tolist(), strict=True)):
            run_id, attempt, key, rank = series[sid]
            out.append({
                "run_id": run_id, "key": key, "level": level, "bucket": bucket, "rank": rank, "attempt": attempt,
                "min_step": int(lo[1][i]), "min_value": float(lo[0][i]), "min_ts": float(lo[2][i]),
                "max_step": int(hi[1][i]), "max_value": float(hi[0][i]), "max_ts": float(hi[2][i]),
                "sum": float(sums[i]), "count": count,
            })  # fmt: skip
    return out


def _pick(
    side: tuple[np.ndarray, np.ndarray, np.ndarray], starts: np.ndarray, reduce: np.ufunc, first: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group (rows ``starts[i]`` up to the next start): the (value, step, ts) of its extreme
    ``reduce`` picks, the group's first such row (``first``) or its last (rows are in step order)."""
    values = side[0]
    extreme = reduce.reduceat(values, starts)
    sizes = np.diff(np.r_[starts, len(values)])
    index = np.arange(len(values))
    hits = values == np.repeat(extreme, sizes)
    if first:
        chosen = np.minimum.reduceat(np.where(hits, index, len(values)), starts)
    else:
        chosen = np.maximum.reduceat(np.where(hits, index, -1), starts)
    return extreme, side[1][chosen], side[2][chosen]


def merge(session: Session, blocks: list[dict[str, Any]]) -> None:
    """Upserts blocks: extremes keep the more extreme side, sums and counts add up. In the order of
    their unique key, the same in every process: two ingest processes may merge into one run's
    blocks at once, and rows locked in opposite orders would deadlock."""
    blocks = sorted(blocks, key=lambda b: (b["run_id"], b["key"], b["level"], b["bucket"], b["rank"], b["attempt"]))
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
