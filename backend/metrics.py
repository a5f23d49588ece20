"""Reading metrics back: per rank and aggregated across ranks, downsampled by min/max per
bucket so a spike survives any zoom level (TensorBoard's random sampling and MLflow's even
sampling both lose it)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend import rollups
from backend.models import Metric

RAW_FACTOR = 16  # rows are read while a range holds at most this many times the points asked for


def keys(session: Session, run_id: int) -> list[str]:
    return list(session.scalars(select(Metric.key).where(Metric.run_id == run_id).distinct().order_by(Metric.key)))


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
    for rank, points in sorted(by_rank.items()):
        arr = np.array(points, dtype=np.float64)
        steps, (vals, tss) = downsample(arr[:, 0].astype(np.int64), [arr[:, 1], arr[:, 2]], max_points or len(arr))
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
        aggregate = {
            "step": steps.tolist(),
            "mean": _json_floats(mean),
            "min": _json_floats(lo),
            "max": _json_floats(hi),
        }
    return {"run_id": run_id, "key": key, "ranks": ranks, "aggregate": aggregate, "bucket_steps": 1}


def _from_rollups(session: Session, run_id: int, key: str, max_points: int, lo: int, hi: int) -> dict[str, Any]:
    """Two points per block of 2**level steps: where its minimum and its maximum were."""
    level = rollups.level_for(hi - lo + 1, max_points)
    by_rank: dict[int, list[tuple[int, float, float]]] = {}
    blocks: dict[int, dict[str, Any]] = {}
    for b in rollups.read(session, run_id, key, level, lo, hi):
        extremes = {(b.min_step, b.min_value, b.min_ts), (b.max_step, b.max_value, b.max_ts)}
        by_rank.setdefault(b.rank, []).extend(sorted(p for p in extremes if lo <= p[0] <= hi))
        block = blocks.setdefault(b.bucket, {"min": (math.inf, 0), "max": (-math.inf, 0), "sum": 0.0, "count": 0})
        block["min"] = min(block["min"], (b.min_value, b.min_step))
        block["max"] = max(block["max"], (b.max_value, b.max_step))
        block["sum"] += b.sum
        block["count"] += b.count
    ranks = {
        str(rank): {"step": [p[0] for p in pts], "value": [p[1] for p in pts], "ts": [p[2] for p in pts]}
        for rank, pts in sorted(by_rank.items())
    }
    aggregate: dict[str, list[Any]] = {"step": [], "mean": [], "min": [], "max": []}
    for _bucket, block in sorted(blocks.items()):
        for step in sorted({s for s in (block["min"][1], block["max"][1]) if lo <= s <= hi}):
            aggregate["step"].append(step)
            aggregate["mean"].append(block["sum"] / block["count"])
            aggregate["min"].append(block["min"][0])
            aggregate["max"].append(block["max"][0])
    for name in ("mean", "min", "max"):
        aggregate[name] = _json_floats(np.array(aggregate[name], dtype=np.float64))
    return {"run_id": run_id, "key": key, "ranks": ranks, "aggregate": aggregate, "bucket_steps": 1 << level}


def _json_floats(values: np.ndarray) -> list[float | None]:
    """JSON has no NaN or infinity: a diverged loss is shown as a gap (null)."""
    return [float(v) if np.isfinite(v) else None for v in values]
