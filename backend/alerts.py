"""Live alerts: a run that gets slower than it was, or starts waiting for communication, says so
while it runs: an event in its state history (and on its live stream) and a series on ``/metrics``.

Ingest watches each run's rank-0 points as it writes them (every rank's step ends with the others'
collectives, so rank 0's step is the run's): throughput (``samples_per_s``; ``steps_per_s`` for a
script without DDP) and ``comm_fraction``, each against its own moving baseline. O(1) per point; per
run and kind one :class:`Baseline` of a few numbers, dropped when the run's streams retire.

- The baseline is the mean of the first points after WARMUP_POINTS (a first step's allocations,
  DDP's bucket rebuild), then an EWMA over ``alert_baseline_steps`` logged steps. Points past the
  threshold do not move it, and while an alert holds it is frozen: a lasting slowdown stays an
  alert instead of becoming the new normal.
- An alert is raised after ``alert_after_steps`` points in a row, spanning ``alert_after_s`` seconds,
  below ``(1 − alert_throughput_drop)`` × the baseline (``comm_fraction``: above it +
  ``alert_comm_fraction_rise``): one event, never one per step. Both, because a run of 3 ms steps
  has 20 slow steps in a row whenever another process takes its core for a moment. It ends, silently, after as many points back within half the threshold; a later drop
  raises a new one.

While an alert holds, the run has a ``run_alerts`` row: with several ingests each sees some of a
run's points, and the row's key lets only the first of them raise the event. Rows go when the
alert ends, a new attempt starts or the run's streams retire."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import Table, delete, select
from sqlalchemy.orm import Session

from backend import bulk, lifecycle
from backend.models import Run, RunAlert, utcnow
from torchyard.settings import Settings


class AlertKind(StrEnum):
    THROUGHPUT = "throughput"
    COMM_FRACTION = "comm_fraction"
    STALL = "stall"  # no step for a while, by default (backend/watchdog.py): not from points


WATCHED = {
    "samples_per_s": AlertKind.THROUGHPUT,
    "steps_per_s": AlertKind.THROUGHPUT,
    "comm_fraction": AlertKind.COMM_FRACTION,
}
WARMUP_POINTS = 5  # an attempt's first points neither alert nor count: its first steps are slow
MIN_BASELINE_POINTS = 10  # a baseline of fewer points is noise: no alert before


@dataclass(slots=True)
class Baseline:
    """One run's moving baseline of one kind, and where its alert stands."""

    attempt: int
    last_step: int = 0
    seen: int = 0  # points of this attempt
    n: int = 0  # points in the baseline
    value: float = 0.0
    streak: int = 0  # points in a row past the threshold (while an alert holds: back within half of it)
    since: int = 0  # the step the streak began at
    since_ts: float = 0.0  # and when (the point's own time)
    alerting: bool = False


class Alerts:
    """Ingest's watch over the runs it writes points for (one per ingest process)."""

    def __init__(self, settings: Settings) -> None:
        self.drop, self.rise = settings.alert_throughput_drop, settings.alert_comm_fraction_rise
        self.alpha = 2 / (settings.alert_baseline_steps + 1)
        self.after, self.after_s = settings.alert_after_steps, settings.alert_after_s
        self.baselines: dict[tuple[int, AlertKind], Baseline] = {}

    def snapshot(self) -> dict[tuple[int, AlertKind], Baseline]:
        """Taken before a batch: restored if its transaction fails (its points come again)."""
        return {key: replace(b) for key, b in self.baselines.items()}

    def restore(self, saved: dict[tuple[int, AlertKind], Baseline]) -> None:
        self.baselines = saved

    def check(self, session: Session, rows: Iterable[tuple[Any, ...]]) -> None:
        """Watches newly written points (``rollups.COLUMNS``: run, attempt, key, rank, step, value,
        ts); raises and ends alerts in the session's transaction."""
        watched = sorted(
            (run_id, attempt, step, WATCHED[key], key, value, ts)
            for run_id, attempt, key, rank, step, value, ts in rows
            if rank == 0 and key in WATCHED and value is not None
        )
        for run_id, attempt, step, kind, key, value, ts in watched:
            b = self.baselines.get((run_id, kind))
            if b is None or attempt > b.attempt:  # a new attempt starts slow again: a new baseline
                if b is not None and b.alerting:  # the old attempt's alert ended with it
                    session.execute(delete(RunAlert).where(RunAlert.run_id == run_id, RunAlert.kind == kind))
                b = self.baselines[run_id, kind] = Baseline(attempt)
            if attempt < b.attempt or step <= b.last_step:  # a late point of an old attempt, a replayed step
                continue
            b.last_step = step
            change = self._observe(b, kind, step, value, ts)
            if change is True:
                raise_alert(session, run_id, kind, b.since, self._text(kind, key, b.value, value, b.since))
            elif change is False:
                end_alert(session, run_id, kind)

    def forget(self, session: Session, run_ids: set[int]) -> None:
        """The runs ended and their streams retired: their baselines and alerts go."""
        self.baselines = {key: b for key, b in self.baselines.items() if key[0] not in run_ids}
        if run_ids:
            session.execute(delete(RunAlert).where(RunAlert.run_id.in_(run_ids)))

    def _observe(self, b: Baseline, kind: AlertKind, step: int, value: float, ts: float) -> bool | None:
        """True: an alert starts; False: it ends; None: nothing changes."""
        b.seen += 1
        if b.seen <= WARMUP_POINTS:
            return None
        if b.n >= MIN_BASELINE_POINTS:
            if kind == AlertKind.THROUGHPUT:
                off, back = value < (1 - self.drop) * b.value, value >= (1 - self.drop / 2) * b.value
            else:
                off, back = value > b.value + self.rise, value <= b.value + self.rise / 2
            b.streak = b.streak + 1 if (back if b.alerting else off) else 0
            if b.streak == 1:
                b.since, b.since_ts = step, ts
            if b.streak >= self.after and ts - b.since_ts >= self.after_s:
                b.alerting, b.streak = not b.alerting, 0
                return b.alerting
            if b.alerting or off:
                return None
        b.n += 1
        b.value += (value - b.value) * max(self.alpha, 1 / b.n)  # the mean of the first points, then an EWMA
        return None

    def _text(self, kind: AlertKind, key: str, baseline: float, value: float, step: int) -> str:
        if kind == AlertKind.THROUGHPUT:
            return (
                f"slower: throughput {1 - value / baseline:.0%} below its moving baseline from step {step} "
                f"({key} {baseline:.4g} → {value:.4g} on rank 0; alert at a drop of {self.drop:.0%})"
            )
        return (
            f"waiting for communication: comm fraction {value:.0%} of the step from step {step}, its moving "
            f"baseline {baseline:.0%} (rank 0; alert at a rise of {self.rise * 100:.0f} points)"
        )


def raise_alert(session: Session, run_id: int, kind: AlertKind, step: int, text: str) -> bool:
    """The alert starts on a running run: its row (one per run and kind) and an event in its
    history. False where it already held (another ingest raised it) or the run is no longer running."""
    run = session.get(Run, run_id)
    if run is None or run.status != lifecycle.RUNNING:  # its last points came after it ended
        return False
    row = {"run_id": run_id, "kind": str(kind), "step": step, "raised_at": utcnow()}
    if not bulk.insert(session, cast(Table, RunAlert.__table__), [row], returning=("run_id",)):
        return False
    lifecycle.record_alert(session, run, kind, text)
    return True


def end_alert(session: Session, run_id: int, kind: AlertKind) -> None:
    """The alert ends, silently (the run is back to normal)."""
    session.execute(delete(RunAlert).where(RunAlert.run_id == run_id, RunAlert.kind == kind))


def holding(session: Session, kind: AlertKind) -> set[int]:
    """The runs an alert of this kind holds on (one query, for a pass over every running run)."""
    return set(session.scalars(select(RunAlert.run_id).where(RunAlert.kind == str(kind))))


def active(session: Session) -> list[tuple[int, str]]:
    """(run, kind) of every alert that holds on a running run."""
    rows = session.execute(
        select(RunAlert.run_id, RunAlert.kind)
        .join(Run)
        .where(Run.status == lifecycle.RUNNING)
        .order_by(RunAlert.run_id)
    )
    return [(run_id, kind) for run_id, kind in rows]
