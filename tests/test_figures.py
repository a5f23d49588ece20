"""A run's headline figures (backend/figures.py) by their definitions, on both databases: throughput
is the global batch over the step time (the slowest rank's at a step, the mean over the run),
the newest attempt's value where a resumed attempt logged a step again, best and final loss
likewise; from the rows for a short run and from the rollups for a long one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.orm import Session

from backend import figures
from backend.ingest import apply_entries
from backend.models import Attempt, Run
from testkit.stack import run_spec
from torchyard import streams

pytestmark = pytest.mark.timeout(60)

# (attempt, first step, last step, per-rank step time, loss at step s, comm fraction): attempt 2
# resumed at step 100 and logged 101–200 again, faster and at a higher loss than attempt 1 had there
ATTEMPTS = [
    (1, 1, 150, (0.1, 0.2), lambda s: 2.0 - s / 100, 0.5),
    (2, 101, 200, (0.05, 0.05), lambda s: 1.5 + (s - 100) / 1000, 0.25),
]


@pytest.fixture
def session(session_on_both: Session) -> Session:
    """Both databases: the figures are aggregated in SQL."""
    return session_on_both


def resumed_run(
    session: Session, spec: dict[str, Any] | None = None
) -> tuple[Run, dict[tuple[int, int], dict[str, float]]]:
    """The run of ATTEMPTS through ingest's own write path, and each (rank, step)'s newest values."""
    start = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)
    run = Run(name="r", status="succeeded", spec=spec or run_spec(batch_size=64), priority=0)
    run.started_at, run.ended_at = start, start + timedelta(seconds=95)
    session.add(run)
    session.flush()
    newest: dict[tuple[int, int], dict[str, float]] = {}
    for attempt, first, last, times, loss, comm in ATTEMPTS:
        session.add(Attempt(run_id=run.id, number=attempt, status="succeeded"))
        session.flush()
        entries = []
        for rank in (0, 1):
            points = []
            for s in range(first, last + 1):
                values = {
                    "step_time_s": times[rank],
                    "samples_per_s": 32 / times[rank],
                    "loss": loss(s) + (0.1 if rank else -0.1),
                    "comm_fraction": comm,
                    "comm_bytes": 4000.0 * (rank + 1) * attempt,
                    "max_rss_bytes": 1e6 + 1000 * s + 500 * rank,
                }
                points.append([s, 1000.0 + s, values])
                newest[(rank, s)] = values
            entry = {"attempt": attempt, "rank": rank, "points": points, "dropped": 0}
            entries.append((streams.run_stream(run.id), f"{attempt}{rank}-0", streams.encode(streams.METRICS, entry)))
        apply_entries(session, entries)
    session.commit()
    session.refresh(run)
    return run, newest


def across_ranks(newest: dict[tuple[int, int], dict[str, float]], key: str) -> dict[int, float]:
    steps = sorted({s for _, s in newest})
    return {s: (newest[(0, s)][key] + newest[(1, s)][key]) / 2 for s in steps}


def test_throughput_and_loss_follow_their_definitions_across_a_resume(session: Session) -> None:
    run, newest = resumed_run(session)
    assert run.last_step == 200
    last = figures.last_step_figures(session, [run])[run.id]
    assert last == pytest.approx((64 / 0.05, 0.25))  # the newest attempt's last step, its slowest rank

    got = figures.run_summary(session, run)
    every_time = [v["step_time_s"] for v in newest.values()]
    assert got["mean_samples_per_s"] == pytest.approx(64 / (sum(every_time) / len(every_time)))
    assert got["mean_samples_per_s"] == pytest.approx(640)  # (100 × 0.15 + 100 × 0.05) / 200 = 0.1 s
    assert got["mean_comm_fraction"] == pytest.approx((100 * 0.5 + 100 * 0.25) / 200)
    loss = across_ranks(newest, "loss")
    assert got["best_loss"] == pytest.approx(min(loss.values())) == pytest.approx(1.0)  # not attempt 1's 0.5
    assert (got["final_loss_step"], got["final_loss"]) == (200, pytest.approx(loss[200]))
    assert got["wall_time_s"] == 95
    assert got["mean_comm_bytes"] == pytest.approx(
        sum(v["comm_bytes"] for v in newest.values()) / len(newest)
    )  # the newest attempt's where it logged a step again: steps 1–100 attempt 1's, 101–200 attempt 2's
    assert got["peak_memory_bytes"] == 1e6 + 1000 * 200 + 500  # rank 1's at the last step


def test_a_long_runs_best_loss_is_the_best_block_mean_from_the_rollups(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, _newest = resumed_run(session)
    monkeypatch.setattr(figures, "BEST_RAW_STEPS", 50)  # this run counts as long: the rollups' path
    width = 1 << figures.BEST_LEVEL
    by_block: dict[int, dict[int, list[float]]] = {}  # block → attempt → every rank's loss there
    for attempt, first, last, _times, loss, _comm in ATTEMPTS:
        for s in range(first, last + 1):
            by_block.setdefault(s // width, {}).setdefault(attempt, []).extend([loss(s) - 0.1, loss(s) + 0.1])
    # a block a resumed attempt logged again: its steps there
    expected = min(sum(vs) / len(vs) for attempts in by_block.values() for vs in [attempts[max(attempts)]])
    assert figures.run_summary(session, run)["best_loss"] == pytest.approx(expected)
    assert expected > 1.5, "attempt 1's replayed, lower losses (block 1: 1.05) are not counted"


def test_a_scripts_throughput_is_what_its_ranks_report_added_up(session: Session) -> None:
    spec = {"name": "s", "workload": {"kind": "script", "bundle": "0" * 64, "entry": "train.py"}}
    run, newest = resumed_run(session, spec)
    assert figures.last_step_figures(session, [run])[run.id][0] == pytest.approx(2 * 32 / 0.05)
    per_rank = [[v["samples_per_s"] for (r, _), v in newest.items() if r == rank] for rank in (0, 1)]
    assert figures.run_summary(session, run)["mean_samples_per_s"] == pytest.approx(
        sum(sum(p) / len(p) for p in per_rank)
    )
