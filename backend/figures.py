"""A run's headline figures, one definition each, for the runs list, the run page and compare.

Throughput is the global batch over the step time: a step is done when its slowest rank is, so at
one step it is the batch over the slowest rank's ``step_time_s``; over a run, the batch over the
mean step time (every rank and step). Each rank's own ``samples_per_s`` is not summed: a pipeline
rank reports the whole batch, and a resumed attempt logs the replayed steps again. A script's batch
is its own, so its throughput is what its ranks report, added up. Where a step was logged by more
than one attempt, the newest attempt's value counts, as on the charts."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session

from backend import metrics, rollups
from backend.models import Metric, MetricRollup, Run
from torchyard.spec import ScriptConfig

# Up to this many steps, best_loss is the lowest across-rank mean of any one step, read from the rows;
# beyond, the lowest mean of a block of 2**BEST_LEVEL steps, summed from the rollups in the database
# (a million-step run read row by row took 1.3 s on SQLite, its 15,625 blocks as objects 0.5 s).
BEST_RAW_STEPS = 20_000
BEST_LEVEL = rollups.LEVELS[0]
MEAN_LEVEL = rollups.LEVELS[-1]  # means over a whole run: the coarsest blocks, fewest rows


def last_step_figures(session: Session, items: Sequence[Run]) -> dict[int, tuple[float | None, float | None]]:
    """Per run of a page, its throughput and comm fraction at its last step, from its newest attempt
    only: throughput is the global batch over the slowest rank's step time, comm fraction the mean
    over ranks. One indexed query for the whole page."""
    newest = {r.id: max((a.number for a in r.attempts), default=1) for r in items}
    triples = [(r.id, r.last_step, newest[r.id]) for r in items if r.last_step > 0]
    if not triples:
        return {}
    rows = session.execute(
        select(Metric.run_id, Metric.key, func.max(Metric.value), func.avg(Metric.value), func.sum(Metric.value))
        .where(
            Metric.key.in_(("step_time_s", "samples_per_s", "comm_fraction")),
            tuple_(Metric.run_id, Metric.step, Metric.attempt).in_(triples),
        )
        .group_by(Metric.run_id, Metric.key)
    ).all()
    by_run: dict[int, dict[str, tuple[float, float, float]]] = {}
    for run_id, key, most, mean, total in rows:
        by_run.setdefault(run_id, {})[key] = (most, mean, total)
    runs = {r.id: r for r in items}
    figures: dict[int, tuple[float | None, float | None]] = {}
    for run_id, got in by_run.items():
        slowest = got.get("step_time_s", (None, None, None))[0]
        total = got.get("samples_per_s", (None, None, None))[2]
        figures[run_id] = (_throughput(runs[run_id], slowest, total), got.get("comm_fraction", (None, None, None))[1])
    return figures


def run_summary(session: Session, run: Run, now: datetime | None = None) -> dict[str, Any]:
    """The run page's and compare's figures: mean throughput and comm fraction over the run, the
    final and best loss, and the wall time so far."""
    step_time = _rank_means(session, run, "step_time_s")
    reported = _rank_means(session, run, "samples_per_s")
    comm = _rank_means(session, run, "comm_fraction")
    final_step, final_loss = _final(session, run.id, "loss")
    return {
        "mean_samples_per_s": _throughput(
            run, _mean(step_time), sum(t / n for t, n in reported.values()) if reported else None
        ),
        "mean_comm_fraction": _mean(comm),
        "final_loss": final_loss,
        "final_loss_step": final_step,
        "best_loss": _best(session, run, "loss"),
        "wall_time_s": _wall_time(run, now or datetime.now(UTC)),
        "mean_comm_bytes": _mean(_rank_means(session, run, "comm_bytes")),
        "peak_memory_bytes": _peak(session, run, "cuda_max_allocated_bytes") or _peak(session, run, "max_rss_bytes"),
    }


def _peak(session: Session, run: Run, key: str) -> float | None:
    """The highest value of ``key`` any rank logged (from the coarsest rollups)."""
    highs = [b.max_value for b in metrics.blocks(session, run.id, key, MEAN_LEVEL, 0, run.last_step)]
    return max((v for v in highs if v is not None), default=None)


def _throughput(run: Run, step_time: float | None, reported_total: float | None) -> float | None:
    if isinstance(run.run_spec.workload, ScriptConfig):
        return reported_total  # its batch is its own: what its ranks report, added up
    return run.run_spec.training.batch_size / step_time if step_time else None


def _rank_means(session: Session, run: Run, key: str) -> dict[int, tuple[float, int]]:
    """Per rank, the sum and count of ``key`` over the run (newest attempt per step), from the
    coarsest rollups: a few rows per rank however long the run."""
    out: dict[int, tuple[float, int]] = {}
    for b in metrics.blocks(session, run.id, key, MEAN_LEVEL, 0, run.last_step):
        total, n = out.get(b.rank, (0.0, 0))
        out[b.rank] = (total + b.total, n + b.n)
    return out


def _mean(per_rank: dict[int, tuple[float, int]]) -> float | None:
    n = sum(k for _, k in per_rank.values())
    return sum(t for t, _ in per_rank.values()) / n if n else None


def _final(session: Session, run_id: int, key: str) -> tuple[int | None, float | None]:
    """The last step that logged ``key`` and its across-rank mean there (the newest attempt's)."""
    step = session.scalar(select(func.max(Metric.step)).where(Metric.run_id == run_id, Metric.key == key))
    if step is None:
        return None, None
    rows = session.execute(
        select(Metric.attempt, Metric.value).where(Metric.run_id == run_id, Metric.key == key, Metric.step == step)
    ).all()
    newest = max(a for a, _ in rows)
    values = [v for a, v in rows if a == newest and v is not None]  # NULL: a NaN loss
    return step, (sum(values) / len(values) if values else None)


def _best(session: Session, run: Run, key: str) -> float | None:
    """The lowest across-rank mean of ``key``: of one step (the newest attempt's), or past
    BEST_RAW_STEPS of a block of 2**BEST_LEVEL steps (where a resumed attempt logged the block
    again, of its steps there), summed in the database from the rollups."""
    if run.last_step <= BEST_RAW_STEPS:
        rows = session.execute(
            select(Metric.step, Metric.attempt, func.avg(Metric.value))
            .where(Metric.run_id == run.id, Metric.key == key)
            .group_by(Metric.step, Metric.attempt)
            .order_by(Metric.step, Metric.attempt)
        ).all()
    else:
        rows = session.execute(
            select(
                MetricRollup.bucket,
                MetricRollup.attempt,
                func.sum(MetricRollup.sum) / func.sum(MetricRollup.count),
            )
            .where(MetricRollup.run_id == run.id, MetricRollup.key == key, MetricRollup.level == BEST_LEVEL)
            .group_by(MetricRollup.bucket, MetricRollup.attempt)
            .order_by(MetricRollup.bucket, MetricRollup.attempt)
        ).all()
    newest = {at: mean for at, _attempt, mean in rows}  # ordered by attempt: a later one overwrites
    return min((m for m in newest.values() if m is not None), default=None)


def _wall_time(run: Run, now: datetime) -> float | None:
    if run.started_at is None:
        return None
    return max(0.0, ((run.ended_at or now) - run.started_at).total_seconds())
