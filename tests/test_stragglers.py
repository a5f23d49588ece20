"""Straggler attribution (backend/stragglers.py) on hand-made per-rank figures: the rank the others
wait for is named with its cause, a balanced run names none; read back from the database over a
window of steps; and the ranks × steps heatmap (backend/metrics.py), from the rows and from the
rollups alike, the newest attempt's value where a resumed attempt logged a step again."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.orm import Session

from backend import metrics, stragglers
from backend.ingest import apply_entries
from backend.models import Attempt, Run
from backend.stragglers import RankTimes, attribute
from testkit.stack import run_spec
from torchyard import streams

pytestmark = pytest.mark.timeout(60)


def ranks(*figures: tuple[float, float, float, float | None]) -> list[RankTimes]:
    """Per rank (data, compute, exposed comm, arrival at the first collective), in ms; the parts
    add up to the step time."""
    return [
        RankTimes(r, 50, (d + c + e) / 1e3, d / 1e3, c / 1e3, e / 1e3, None if a is None else a / 1e3)
        for r, (d, c, e, a) in enumerate(figures)
    ]


def test_a_rank_slow_to_load_its_data_is_named_with_the_wait_it_costs_the_others() -> None:
    # rank 1 loads 41 ms longer; rank 0 reaches the all-reduce 40 ms earlier and waits there
    (found,) = attribute(ranks((2, 10, 42, 8), (43, 10, 4, 48)))
    assert (found.rank, found.cause) == (1, "data")
    assert found.late_s == pytest.approx(0.041) and found.others_wait_s == pytest.approx(0.038)  # its busy time
    assert found.text == "rank 1: data loading +41 ms/step, others wait 38 ms/step in all-reduce"


def test_a_rank_slow_after_the_collectives_is_late_to_the_next_step_not_to_this_ones_collective() -> None:
    # rank 1's extra 60 ms come after its all-reduce (its optimizer step, on a throttled host):
    # it reaches each step's collective as early as rank 0, from its own (late) step start
    (found,) = attribute(ranks((2, 10, 62, 1), (2, 70, 2, 2)))
    assert (found.rank, found.cause) == (1, "compute") and found.late_s == pytest.approx(0.060)


def test_a_rank_with_more_compute_is_named_with_compute_among_many() -> None:
    balanced = [(2, 10, 64, 8)] * 7
    found = attribute(ranks(*balanced[:5], (2, 70, 5, 68), *balanced[5:]), "all-gather and reduce-scatter")
    assert [(s.rank, s.cause) for s in found] == [(5, "compute")]
    assert found[0].text == "rank 5: compute +60 ms/step, others wait 59 ms/step in all-gather and reduce-scatter"


def test_without_arrival_times_lateness_is_the_extra_data_and_compute() -> None:
    (found,) = attribute(ranks((2, 10, 42, None), (43, 10, 4, None)))
    assert found.rank == 1 and found.late_s == pytest.approx(0.041)


def test_a_balanced_run_names_none_however_its_ranks_jitter() -> None:
    assert attribute(ranks((2, 10, 6, 8), (3, 11, 4, 10), (2, 9, 7, 7), (4, 10, 5, 9))) == []
    assert attribute(ranks((2, 10, 6, 8))) == []  # one rank waits for nobody


def test_late_but_waited_for_by_nobody_is_no_straggler() -> None:
    # rank 1 arrives 40 ms late, yet rank 0 does not wait longer (local work, no collective to wait in)
    assert attribute(ranks((2, 10, 4, 8), (43, 10, 4, 48))) == []


def test_the_threshold_is_a_share_of_the_step_above_a_noise_floor() -> None:
    # 8 ms late in a 20 ms step: named; 8 ms late in a 200 ms step: under a tenth of it, not named
    assert [s.rank for s in attribute(ranks((1, 5, 14, 5), (9, 5, 6, 13)))] == [1]
    assert attribute(ranks((1, 185, 14, 186), (9, 185, 6, 194))) == []
    assert stragglers.threshold(ranks((1, 1, 1, 1), (1, 1, 1, 1))) == stragglers.NOISE_FLOOR_S


@pytest.fixture
def session(session_on_both: Session) -> Session:
    """Both databases: the heatmap sums its columns in SQL."""
    return session_on_both


def write(session: Session, run: Run, attempt: int, steps: range, values: Any) -> None:
    """Points through ingest's own write path: ``values(rank, step)`` -> that rank's scalars."""
    session.add(Attempt(run_id=run.id, number=attempt, status="running"))
    session.flush()
    entries = []
    for rank in range(run.run_spec.resources.procs_per_node):
        points = [[s, 1000.0 + s, values(rank, s)] for s in steps]
        entry = {"attempt": attempt, "rank": rank, "points": points, "dropped": 0}
        entries.append((streams.run_stream(run.id), f"{attempt}{rank}-0", streams.encode(streams.METRICS, entry)))
    apply_entries(session, entries)
    session.flush()


def a_run(session: Session, procs: int, last_step: int, **spec: Any) -> Run:
    spec = run_spec(procs=procs, batch_size=20 * procs, **spec)
    run = Run(name="r", status="running", spec=spec, priority=0, last_step=last_step)
    session.add(run)
    session.flush()
    return run


def test_the_window_reads_each_ranks_medians_and_names_the_straggler(session: Session) -> None:
    run = a_run(session, 3, 300)

    def parts(rank: int, step: int) -> dict[str, float]:
        slow = rank == 2 and step > 100  # rank 2 computes 50 ms more from step 101; a spike at step 150
        data, compute = 0.002, (0.060 if slow else 0.010) + (1.0 if step == 150 else 0)
        exposed = 0.004 if rank == 2 or step <= 100 else 0.054
        first = data + compute * 0.8
        return {"step_time_s": data + compute + exposed, "data_time_s": data, "compute_time_s": compute,
                "exposed_comm_s": exposed, "first_comm_at_s": first}  # fmt: skip

    write(session, run, 1, range(1, 301), parts)
    found = stragglers.window(session, run)
    assert (found["step_min"], found["step_max"]) == (201, 300)
    assert [(s.rank, s.cause) for s in found["stragglers"]] == [(2, "compute")]
    assert found["headline"] == "rank 2: compute +50 ms/step, others wait 50 ms/step in all-reduce"
    assert [r.rank for r in found["ranks"]] == [0, 1, 2] and found["ranks"][2].steps == 100
    early = stragglers.window(session, run, 100, step_max=100)
    assert early["stragglers"] == [] and early["headline"].startswith("balanced: no rank keeps the others waiting")


def test_a_pipeline_names_no_straggler(session: Session) -> None:
    run = a_run(session, 2, 10)
    run.spec = {**run.spec, "strategy": {"kind": "pipeline"}}
    write(session, run, 1, range(1, 11), lambda rank, step: {"step_time_s": 0.1, "exposed_comm_s": 0.09 * (1 - rank)})
    found = stragglers.window(session, run)
    assert found["stragglers"] == [] and "pipeline stages wait for each other by design" in found["headline"]


def test_the_heatmap_is_each_ranks_mean_per_column_from_rows_or_rollups_alike(session: Session) -> None:
    steps = 20_000
    run = a_run(session, 2, steps)
    write(session, run, 1, range(1, steps + 1), lambda rank, step: {"step_time_s": 0.01 * (1 + rank) + step * 1e-6})
    # attempt 2 resumed at step 10,001 and logged it again, 1 s slower on rank 1
    write(session, run, 2, range(10_001, steps + 1), lambda rank, step: {"step_time_s": 1.0 * rank + step * 1e-6})
    rows = metrics.heatmap(session, run.id, "step_time_s", 100, 1, steps, world=2)
    from_rollups = metrics.heatmap(session, run.id, "step_time_s", 100, 1, steps, world=64)  # too many points for rows
    for got in (rows, from_rollups):
        assert got["ranks"] == [0, 1] and got["bucket_steps"] == 256  # 20,000 / 256 < 100 columns
        assert len(got["steps"]) == len(got["values"][0]) == 79 and got["steps"][:2] == [1, 256]
    for from_rows, rolled in zip(rows["values"], from_rollups["values"], strict=True):
        assert rolled == pytest.approx(from_rows)
    column = 39  # steps 9,984-10,239: attempt 1's up to 10,000, then attempt 2's
    expect_1 = (
        sum(0.02 + s * 1e-6 for s in range(9984, 10_001)) + sum(1.0 + s * 1e-6 for s in range(10_001, 10_240))
    ) / 256
    assert rows["values"][1][column] == pytest.approx(expect_1)
    assert rows["values"][0][78] == pytest.approx(sum(s * 1e-6 for s in range(19_968, 20_001)) / 33)

    window = metrics.heatmap(session, run.id, "step_time_s", 100, 101, 150, world=2)
    assert window["bucket_steps"] == 1 and window["steps"] == list(range(101, 151))
    assert window["values"][0][0] == pytest.approx(0.01 + 101e-6)
    none = metrics.heatmap(session, run.id, "data_time_s", 100, 1, steps, world=2)
    assert none["ranks"] == [] and none["values"] == []
