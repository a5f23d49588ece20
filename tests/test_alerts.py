"""Live alerts (backend/alerts.py) as ingest raises them, through its own write path: a run whose
throughput falls below its moving baseline, or whose comm fraction rises above it, gets one event
(not one per step) and a held alert that /metrics reports, ended when it recovers or the run's
streams retire; a single slow step, rank 1's points and a new attempt's warm-up raise nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend import alerts, stats
from backend.ingest import apply_entries
from backend.models import Attempt, Run, RunAlert, RunEvent
from cli.redis_server import RedisServer
from testkit.ingest import add_run
from torchyard import streams
from torchyard.settings import Settings

pytestmark = pytest.mark.timeout(60)
Values = Callable[[int, int], dict[str, float]]


@pytest.fixture
def run(session: Session) -> Run:
    return add_run(session, "running")


def ingest(session: Session, watch: alerts.Alerts, run: Run, steps: range, values: Values, attempt: int = 1) -> None:
    """Both ranks' points of ``steps``, a step per ingest batch as they come in."""
    for step in steps:
        entries = []
        for rank in (0, 1):
            entry = {
                "attempt": attempt,
                "rank": rank,
                "points": [[step, 1000.0 + step, values(rank, step)]],
                "dropped": 0,
            }
            fields = streams.encode(streams.METRICS, entry)
            entries.append((streams.run_stream(run.id), f"{step}{attempt}{rank}-0", fields))
        apply_entries(session, entries, watch=watch)
    session.flush()


def events(session: Session, run: Run) -> list[RunEvent]:
    return list(session.scalars(select(RunEvent).where(RunEvent.run_id == run.id, RunEvent.alert.is_not(None))))


def held(session: Session) -> list[tuple[int, str]]:
    return [(a.run_id, a.kind) for a in session.scalars(select(RunAlert))]


def speed(slow: Callable[[int], bool]) -> Values:
    """100 samples/s, 50 where ``slow(step)``; rank 1 always at a tenth (it must not count)."""
    return lambda rank, step: {"samples_per_s": (50.0 if slow(step) else 100.0) / (10 if rank else 1)}


def test_a_run_that_slows_down_gets_one_event_held_until_it_recovers(session: Session, run: Run) -> None:
    watch = alerts.Alerts(Settings(alert_after_s=0))  # a drop of 30 %, 3 steps in a row, a 50-step baseline
    ingest(session, watch, run, range(1, 81), speed(lambda step: step >= 41))
    (raised,) = events(session, run)
    assert raised.alert == "throughput" and raised.to_status == raised.from_status == "running"
    assert raised.reason == (
        "slower: throughput 50% below its moving baseline from step 41 (samples_per_s 100 → 50 on rank 0; alert at a "
        "drop of 30%)"
    )
    assert held(session) == [(run.id, "throughput")] and alerts.active(session) == [(run.id, "throughput")]

    ingest(session, watch, run, range(81, 120), speed(lambda step: step >= 110))  # back at 81, slow again at 110
    assert held(session) == [(run.id, "throughput")]
    assert [e.reason.split(" (")[0] for e in events(session, run)] == [
        "slower: throughput 50% below its moving baseline from step 41",
        "slower: throughput 50% below its moving baseline from step 110",
    ]


def test_one_slow_step_or_a_slow_rank_1_raises_nothing(session: Session, run: Run) -> None:
    watch = alerts.Alerts(Settings(alert_after_s=0))
    ingest(session, watch, run, range(1, 61), speed(lambda step: step in (30, 31, 45)))  # 2 in a row: under 3
    assert events(session, run) == [] and held(session) == []


def test_a_slowdown_shorter_than_alert_after_s_raises_nothing(session: Session, run: Run) -> None:
    watch = alerts.Alerts(Settings(alert_after_s=10))  # the points are 1 s apart
    ingest(session, watch, run, range(1, 61), speed(lambda step: 30 <= step < 39))  # 9 slow steps: 8 s
    assert events(session, run) == []
    ingest(session, watch, run, range(61, 100), speed(lambda step: step >= 70))  # 11 s and more
    assert [e.reason.split(" (")[0] for e in events(session, run)] == [
        "slower: throughput 50% below its moving baseline from step 70"
    ]


def test_a_rise_of_the_comm_fraction_is_an_alert_of_its_own(session: Session, run: Run) -> None:
    watch = alerts.Alerts(Settings(alert_comm_fraction_rise=0.25, alert_after_steps=5, alert_after_s=0))
    ingest(session, watch, run, range(1, 51), lambda rank, step: {"comm_fraction": 0.7 if step > 30 else 0.4})
    (raised,) = events(session, run)
    assert raised.alert == "comm_fraction" and raised.reason.startswith(
        "waiting for communication: comm fraction 70% of the step from step 31, its moving baseline 40%"
    )


def test_a_new_attempt_starts_a_new_baseline_and_its_warm_up_raises_nothing(session: Session, run: Run) -> None:
    watch = alerts.Alerts(Settings(alert_after_s=0))
    ingest(session, watch, run, range(1, 41), speed(lambda step: step >= 35))
    assert len(events(session, run)) == 1 and held(session) == [(run.id, "throughput")]
    session.add(Attempt(run_id=run.id, number=2, status="running"))
    # attempt 2 resumes at step 21, its first steps slow; later it runs at 60 %: its own normal
    ingest(session, watch, run, range(21, 61), lambda rank, step: {"samples_per_s": 10.0 if step < 24 else 60.0}, 2)
    assert len(events(session, run)) == 1 and held(session) == []  # attempt 1's alert ended with it


def test_an_ended_run_raises_nothing_and_retiring_it_forgets_it(session: Session, run: Run) -> None:
    watch = alerts.Alerts(Settings(alert_after_s=0))
    ingest(session, watch, run, range(1, 50), speed(lambda step: step >= 41))
    assert len(events(session, run)) == 1
    run.status = "succeeded"
    assert alerts.active(session) == []  # /metrics counts the alerts of running runs
    watch.forget(session, {run.id})
    assert held(session) == [] and watch.baselines == {}
    ingest(session, watch, run, range(50, 90), speed(lambda step: step >= 70))  # points after its end
    assert len(events(session, run)) == 1


def test_metrics_reports_raised_and_held_alerts(session: Session, run: Run, redis_server: RedisServer) -> None:
    watch = alerts.Alerts(Settings(alert_after_s=0))
    ingest(session, watch, run, range(1, 50), speed(lambda step: step >= 41))
    client = redis.Redis.from_url(redis_server.url)
    series = {s.name: s for s in stats.collect(session, client)}
    client.close()
    raised = [({"kind": "throughput"}, 1), ({"kind": "comm_fraction"}, 0), ({"kind": "stall"}, 0)]
    assert series["torchyard_run_alerts_total"].samples == raised
    assert series["torchyard_run_alerts_total"].kind == "counter"
    assert series["torchyard_run_alert"].samples == [({"run": str(run.id), "kind": "throughput"}, 1)]


def test_of_two_ingests_that_both_see_the_slowdown_only_one_raises_the_event(session: Session, run: Run) -> None:
    first, second = alerts.Alerts(Settings(alert_after_s=0)), alerts.Alerts(Settings(alert_after_s=0))
    rows = [(run.id, 1, "samples_per_s", 0, step, 50.0 if step >= 41 else 100.0, 0.0) for step in range(1, 61)]
    first.check(session, rows)
    second.check(session, rows)  # its own baseline says "raise" too: the held alert's key says no
    assert len(events(session, run)) == 1 and held(session) == [(run.id, "throughput")]
    assert first.baselines[run.id, alerts.AlertKind.THROUGHPUT].alerting
    assert second.baselines[run.id, alerts.AlertKind.THROUGHPUT].alerting
