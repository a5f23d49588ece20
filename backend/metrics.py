"""Reading metrics back: per rank and aggregated across ranks, downsampled by min/max per
bucket so a spike survives any zoom level (TensorBoard's random sampling and MLflow's even
sampling both lose it)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend import rollups
from backend.models import Metric, MetricRollup, RunMetricKey

RAW_FACTOR = 16  # rows are read while a range holds at most this many times the points asked for
MAX_POINTS = 10_000  # the most points per series one read may ask for (a chart is a few thousand pixels wide)


def keys(session: Session, run_id: int) -> list[str]:
    """The run's metric keys (at most TORCHYARD_MAX_METRIC_KEYS: ingest drops points of more)."""
    return list(
        session.scalars(select(RunMetricKey.key).where(RunMetricKey.run_id == run_id).order_by(RunMetricKey.key))
    )


def downsample(steps: np.ndarray, values: Sequence[np.ndarray], max_points: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Keeps, per bucket of consecutive steps, the rows holding the minimum and the maximum of
    the first series (the others ride along at the same rows), in step order. At most
    ``max_points`` rows come back."""
    n = len(steps)
    if n <= max_points or max_points < 2:
        return steps, list(values)
    buckets = max_points // 2
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    lead = values[0]
    keep = np.empty(2 * buckets, dtype=np.int64)
    for b in range(buckets):
        lo, hi = edges[b], edges[b + 1]
        if hi <= lo:
            keep[2 * b] = keep[2 * b + 1] = lo
            continue
        chunk = lead[lo:hi]
        keep[2 * b] = lo + int(np.nanargmin(chunk)) if not np.all(np.isnan(chunk)) else lo
        keep[2 * b + 1] = lo + int(np.nanargmax(chunk)) if not np.all(np.isnan(chunk)) else hi - 1
    keep = np.unique(keep)
    return steps[keep], [v[keep] for v in values]


def series(
    session: Session,
    run_id: int,
    key: str,
    max_points: int | None,
    step_min: int | None = None,
    step_max: int | None = None,
    last_step: int = 0,
) -> dict[str, Any]:
    """Per-rank series and the across-rank mean/min/max per step, at most ``max_points`` per
    series. A range far larger than that is read from the rollups (min/max per block of steps);
    otherwise from the rows, where a step replayed by a later attempt shows the latest value."""
    first, last = step_min or 0, step_max if step_max is not None else last_step
    if max_points and last - first + 1 > RAW_FACTOR * max_points:
        return _from_rollups(session, run_id, key, max_points, first, last)
    where = [Metric.run_id == run_id, Metric.key == key]
    if step_min is not None:
        where.append(Metric.step >= step_min)
    if step_max is not None:
        where.append(Metric.step <= step_max)
    rows = session.execute(
        select(Metric.rank, Metric.step, Metric.attempt, Metric.value, Metric.ts)
        .where(*where)
        .order_by(Metric.step, Metric.rank, Metric.attempt)
    ).all()
    latest: dict[tuple[int, int], tuple[float, float]] = {}
    for rank, step, _attempt, value, ts in rows:  # ordered by attempt: later overwrites earlier
        latest[(rank, step)] = (math.nan if value is None else value, ts)

    by_rank: dict[int, list[tuple[int, float, float]]] = {}
    for (rank, step), (value, ts) in latest.items():
        by_rank.setdefault(rank, []).append((step, value, ts))
    ranks: dict[str, Any] = {}
    downsampled = False
    for rank, points in sorted(by_rank.items()):
        arr = np.array(points, dtype=np.float64)
        steps, (vals, tss) = downsample(arr[:, 0].astype(np.int64), [arr[:, 1], arr[:, 2]], max_points or len(arr))
        downsampled |= len(steps) < len(arr)
        ranks[str(rank)] = {"step": steps.tolist(), "value": _json_floats(vals), "ts": tss.tolist()}

    aggregate: dict[str, Any] = {"step": [], "mean": [], "min": [], "max": []}
    if latest:
        all_steps = np.array([s for (_r, s) in latest], dtype=np.int64)
        all_vals = np.array([v for (v, _t) in latest.values()], dtype=np.float64)
        uniq, inverse = np.unique(all_steps, return_inverse=True)
        count = np.bincount(inverse, minlength=len(uniq))
        mean = np.bincount(inverse, weights=all_vals, minlength=len(uniq)) / count
        lo = np.full(len(uniq), np.inf)
        hi = np.full(len(uniq), -np.inf)
        np.minimum.at(lo, inverse, all_vals)
        np.maximum.at(hi, inverse, all_vals)
        # Bucket on the max so a spike on any rank survives; min and mean ride along per step.
        steps, (hi, lo, mean) = downsample(uniq, [hi, lo, mean], max_points or len(uniq))
        downsampled |= len(steps) < len(uniq)
        aggregate = {
            "step": steps.tolist(),
            "mean": _json_floats(mean),
            "min": _json_floats(lo),
            "max": _json_floats(hi),
        }
    return {
        "run_id": run_id,
        "key": key,
        "ranks": ranks,
        "aggregate": aggregate,
        "bucket_steps": 1,
        "downsampled": downsampled,
    }


class Block(NamedTuple):
    """One rank's key over one block of steps: where its extremes were, its sum and count."""

    rank: int
    bucket: int
    min_step: int
    min_value: float
    min_ts: float
    max_step: int
    max_value: float
    max_ts: float
    total: float
    n: int  # points in the block


def blocks(session: Session, run_id: int, key: str, level: int, lo: int, hi: int) -> list[Block]:
    """The blocks over [lo, hi]: from the rollup where one attempt logged the block, from the rows
    (the newest attempt's value per step) where a resumed attempt logged its steps again."""
    by_block: dict[tuple[int, int], list[Any]] = {}
    for r in rollups.read(session, run_id, key, level, lo, hi):
        by_block.setdefault((r.rank, r.bucket), []).append(r)
    found = [
        Block(r.rank, r.bucket, r.min_step, r.min_value, r.min_ts, r.max_step, r.max_value, r.max_ts, r.sum, r.count)
        for (r, *others) in by_block.values()
        if not others
    ]
    replayed = sorted({bucket for (_rank, bucket), rows in by_block.items() if len(rows) > 1})
    for first, last in _runs(replayed):
        rows = session.execute(
            select(Metric.rank, Metric.step, Metric.value, Metric.ts)
            .where(Metric.run_id == run_id, Metric.key == key)
            .where(Metric.step >= first << level, Metric.step < (last + 1) << level)
            .order_by(Metric.step, Metric.rank, Metric.attempt)
        ).all()
        latest = {(rank, step): (value, ts) for rank, step, value, ts in rows}  # later attempts overwrite
        points: dict[tuple[int, int], list[tuple[float, int, float]]] = {}
        for (rank, step), (value, ts) in latest.items():
            if value is not None and not math.isnan(value):
                points.setdefault((rank, step >> level), []).append((value, step, ts))
        for (rank, bucket), pts in points.items():
            low, high = min(pts), max(pts)
            found.append(Block(rank, bucket, low[1], low[0], low[2], high[1], high[0], high[2],
                                sum(p[0] for p in pts), len(pts)))  # fmt: skip
    return sorted(found, key=lambda b: (b.bucket, b.rank))


def _runs(buckets: list[int]) -> list[tuple[int, int]]:
    """Consecutive bucket numbers as (first, last) runs: one read of rows per replayed range."""
    out: list[tuple[int, int]] = []
    for b in buckets:
        if out and out[-1][1] == b - 1:
            out[-1] = (out[-1][0], b)
        else:
            out.append((b, b))
    return out


def _from_rollups(session: Session, run_id: int, key: str, max_points: int, lo: int, hi: int) -> dict[str, Any]:
    """Two points per block of 2**level steps: where its minimum and its maximum were."""
    level = rollups.level_for(hi - lo + 1, max_points)
    by_rank: dict[int, list[tuple[int, float, float]]] = {}
    across: dict[int, dict[str, Any]] = {}  # per block, over every rank
    for b in blocks(session, run_id, key, level, lo, hi):
        extremes = {(b.min_step, b.min_value, b.min_ts), (b.max_step, b.max_value, b.max_ts)}
        by_rank.setdefault(b.rank, []).extend(sorted(p for p in extremes if lo <= p[0] <= hi))
        block = across.setdefault(b.bucket, {"min": (math.inf, 0), "max": (-math.inf, 0), "sum": 0.0, "count": 0})
        block["min"] = min(block["min"], (b.min_value, b.min_step))
        block["max"] = max(block["max"], (b.max_value, b.max_step))
        block["sum"] += b.total
        block["count"] += b.n
    ranks = {
        str(rank): {"step": [p[0] for p in pts], "value": [p[1] for p in pts], "ts": [p[2] for p in pts]}
        for rank, pts in sorted(by_rank.items())
    }
    aggregate: dict[str, list[Any]] = {"step": [], "mean": [], "min": [], "max": []}
    for _bucket, block in sorted(across.items()):
        for step in sorted({s for s in (block["min"][1], block["max"][1]) if lo <= s <= hi}):
            aggregate["step"].append(step)
            aggregate["mean"].append(block["sum"] / block["count"])
            aggregate["min"].append(block["min"][0])
            aggregate["max"].append(block["max"][0])
    for name in ("mean", "min", "max"):
        aggregate[name] = _json_floats(np.array(aggregate[name], dtype=np.float64))
    return {
        "run_id": run_id,
        "key": key,
        "ranks": ranks,
        "aggregate": aggregate,
        "bucket_steps": 1 << level,
        "downsampled": True,  # two points per block of steps
    }


MAX_HEATMAP_CELLS = 200_000  # ranks × columns in one heatmap (64 ranks × 3,125 columns)
# A heatmap over at most this many points (steps × ranks) sums the rows in the database (~0.2 s on
# SQLite here), past it the rollups' blocks (~0.05 s for 64 ranks × 10,000 steps, where the rows took 0.5 s).
HEATMAP_RAW_ROWS = 200_000


def heatmap(session: Session, run_id: int, key: str, columns: int, lo: int, hi: int, world: int) -> dict[str, Any]:
    """Ranks × steps: each rank's mean of ``key`` over each column of steps in [lo, hi]. Columns are
    blocks of 2**k steps (aligned as the rollups' blocks are, the first and last whole), the finest
    that give at most ``columns`` (fewer where ``world`` ranks would pass MAX_HEATMAP_CELLS). The
    database sums each column: over the rows, or past HEATMAP_RAW_ROWS points over the rollups'
    blocks at their finest level at least as coarse (64 ranks × 100,000 steps: ~25,000 rollup rows
    instead of 6.4 million). A mean, not min/max: a cell's colour is where that rank's time
    usually went over its steps; the charts keep the spikes."""
    columns = max(1, min(columns, MAX_HEATMAP_CELLS // max(1, world)))
    width = 0
    while (hi >> width) - (lo >> width) + 1 > columns:
        width += 1
    if hi < lo:
        return {"run_id": run_id, "key": key, "step_min": lo, "step_max": hi, "ranks": [], "steps": [],
                "bucket_steps": 1, "values": []}  # fmt: skip
    level = None
    if (hi - lo + 1) * world > HEATMAP_RAW_ROWS:
        level = next((level for level in rollups.LEVELS if level >= width), rollups.LEVELS[-1])
        width = max(width, level)
    first, ncols = lo >> width, (hi >> width) - (lo >> width) + 1
    rank, col, total, count = _column_sums(session, run_id, key, first, first + ncols - 1, width, level)
    ranks, row = np.unique(rank, return_inverse=True)
    cell = row * ncols + col - first
    sums = np.bincount(cell, weights=total, minlength=len(ranks) * ncols)
    counts = np.bincount(cell, weights=count, minlength=len(ranks) * ncols)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = (sums / counts).reshape(len(ranks), ncols)  # 0/0: no point there, a gap (null)
    return {
        "run_id": run_id,
        "key": key,
        "step_min": lo,
        "step_max": hi,
        "ranks": ranks.tolist(),
        "steps": [max(lo, (first + c) << width) for c in range(ncols)] if len(ranks) else [],
        "bucket_steps": 1 << width,
        "values": [_json_floats(r) for r in means],
    }


def _column_sums(
    session: Session, run_id: int, key: str, first: int, last: int, width: int, level: int | None
) -> tuple[np.ndarray, ...]:
    """(rank, column, sum, count) of ``key`` per rank and column of 2**width steps, columns
    ``first``..``last``, summed in the database from the rows, or (``level``) from the rollups' blocks
    of 2**level steps. Where more than one attempt logged a column (a resumed attempt replays the
    steps after its checkpoint) it is summed again here from the newest attempt's rows."""
    if level is None:
        column = Metric.step // (1 << width)
        query = select(Metric.rank, column, Metric.attempt, func.sum(Metric.value), func.count(Metric.value)).where(
            Metric.run_id == run_id, Metric.key == key, Metric.step >= first << width, Metric.step < (last + 1) << width
        )
        group = (Metric.rank, column, Metric.attempt)
    else:
        blocks_per_column = 1 << (width - level)
        column = MetricRollup.bucket // blocks_per_column
        query = select(
            MetricRollup.rank, column, MetricRollup.attempt, func.sum(MetricRollup.sum), func.sum(MetricRollup.count)
        ).where(
            MetricRollup.run_id == run_id,
            MetricRollup.key == key,
            MetricRollup.level == level,
            MetricRollup.bucket >= first * blocks_per_column,
            MetricRollup.bucket < (last + 1) * blocks_per_column,
        )
        group = (MetricRollup.rank, column, MetricRollup.attempt)
    by_cell: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for rank, col, _attempt, total, count in session.connection().execute(query.group_by(*group)):
        by_cell.setdefault((rank, col), []).append((total or 0.0, count))
    cells = [(rank, col, *sums[0]) for (rank, col), sums in by_cell.items() if len(sums) == 1]
    replayed = {cell for cell, sums in by_cell.items() if len(sums) > 1}
    for lo, hi in _runs(sorted({col for _rank, col in replayed})):
        points: dict[tuple[int, int], list[float]] = {}
        ranks, steps, values = _newest_rows(session, run_id, key, lo << width, ((hi + 1) << width) - 1)
        for r, c, v in zip(ranks.tolist(), (steps >> width).tolist(), values.tolist(), strict=True):
            if (r, c) in replayed:
                points.setdefault((r, c), []).append(v)
        cells += [(r, c, sum(vs), len(vs)) for (r, c), vs in points.items()]
    arr = np.array(cells, dtype=np.float64).reshape(-1, 4)
    return arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64), arr[:, 2], arr[:, 3]


def _newest_rows(session: Session, run_id: int, key: str, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """(rank, step, value) of ``key`` over [lo, hi], one per rank and step (the newest attempt's),
    NaN left out."""
    rows = (
        session.connection()
        .execute(
            select(Metric.step, Metric.rank, Metric.value)
            .where(Metric.run_id == run_id, Metric.key == key, Metric.step >= lo, Metric.step <= hi)
            .order_by(Metric.step, Metric.rank, Metric.attempt)
        )
        .all()
    )
    arr = np.array([(s, r, math.nan if v is None else v) for s, r, v in rows], dtype=np.float64).reshape(-1, 3)
    step, rank, value = arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64), arr[:, 2]
    # ordered by attempt within a (step, rank): the last row of each is the newest attempt's
    newest = np.r_[(step[1:] != step[:-1]) | (rank[1:] != rank[:-1]), True] & ~np.isnan(value)
    return rank[newest], step[newest], value[newest]


EXPORT_COLUMNS = ("step", "rank", "attempt", "value", "ts")
EXPORT_BATCH = 5000  # rows read and sent at a time: a download of millions of points holds a few thousand


def export(open_session: Callable[[], Session], run_id: int, key: str, fmt: str) -> Iterator[str]:
    """Every point of ``key`` at full resolution (no downsampling), per rank and step, the newest
    attempt's where a resumed attempt logged a step again (as the charts show), ordered by step and
    rank: CSV with a header row, or JSON ``{"run_id", "key", "columns", "rows": [[...], ...]}``.
    Streamed in batches from its own session (a download may outlive the request's)."""
    if fmt == "csv":
        yield ",".join(EXPORT_COLUMNS) + "\n"
    else:
        yield json.dumps({"run_id": run_id, "key": key, "columns": EXPORT_COLUMNS})[:-1] + ', "rows": ['
    first = True
    for rows in _newest_points(open_session, run_id, key):
        if fmt == "csv":
            yield "".join(f"{s},{r},{a},{'' if v is None else repr(v)},{t!r}\n" for s, r, a, v, t in rows)
        else:
            chunk = ",".join(json.dumps([s, r, a, _json_float(v), t]) for s, r, a, v, t in rows)
            yield ("" if first else ",") + chunk
        first = False
    if fmt != "csv":
        yield "]}\n"


def _newest_points(open_session: Callable[[], Session], run_id: int, key: str) -> Iterator[list[tuple[Any, ...]]]:
    """Batches of (step, rank, attempt, value, ts), one row per (step, rank): the newest attempt's."""
    query = (
        select(Metric.step, Metric.rank, Metric.attempt, Metric.value, Metric.ts)
        .where(Metric.run_id == run_id, Metric.key == key)
        .order_by(Metric.step, Metric.rank, Metric.attempt)
    )
    with open_session() as session:
        pending: tuple[Any, ...] | None = None
        batch: list[tuple[Any, ...]] = []
        for row in session.execute(query.execution_options(yield_per=EXPORT_BATCH)):
            if pending is not None and pending[:2] != tuple(row[:2]):  # a later attempt's row replaces it
                batch.append(pending)
                if len(batch) >= EXPORT_BATCH:
                    yield batch
                    batch = []
            pending = tuple(row)
        if pending is not None:
            batch.append(pending)
        if batch:
            yield batch


def _json_float(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _json_floats(values: np.ndarray) -> list[float | None]:
    """JSON has no NaN or infinity: a diverged loss is shown as a gap (null)."""
    return [float(v) if np.isfinite(v) else None for v in values]
