"""Diagnoses through the data layer on a migrated database and a real Redis, no other processes:
a request reaches the workers once committed, each node's answer is kept once, and the watchdog
asks before it ends a stalled attempt, then puts what the dumps say in the failure reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend import alerts, diagnoses, lifecycle, livefeed, watchdog
from backend.models import Diagnosis, Run, RunEvent, utcnow
from cli.redis_server import RedisServer
from tests.test_attempts import placed_run, report
from torchyard import hangdump, streams
from torchyard.settings import Settings

FIXTURES = Path(__file__).parent / "fixtures" / "diagnosis"
DEFAULTS = Settings()


@pytest.fixture
def published(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """What commits publish goes to this Redis (as in the api and the scheduler)."""
    client = redis.Redis.from_url(redis_server.url)
    lifecycle.set_publisher(client)
    yield client
    lifecycle.set_publisher(None)
    client.close()


def running_run(session: Session, **training: Any) -> Run:
    run = placed_run(session, **training)
    report(session, run, "a", "started")
    assert run.status == lifecycle.RUNNING
    return run


def answer(session: Session, run: Run, asked: Diagnosis, fixture: str = "python_all_2") -> None:
    dumps = json.loads((FIXTURES / f"{fixture}.json").read_text())["dumps"]
    data = {"attempt": asked.attempt, "node": "a", "request": asked.request, "procs": 2, "dumps": dumps, "missing": {}}
    diagnoses.record_answer(session, run.id, data)
    session.flush()
    session.refresh(asked)


def test_a_request_reaches_the_workers_once_committed_and_not_after_a_rollback(
    session: Session, published: redis.Redis
) -> None:
    run = running_run(session)
    key = streams.diagnose_key(run.id, 1)
    asked = diagnoses.request(session, run, run.attempts[0], "user", "alice")
    assert published.get(key) is None
    session.commit()
    assert published.get(key) == asked.request.encode() and hangdump.valid_request(asked.request)

    again = diagnoses.request(session, run, run.attempts[0], "user", "alice")
    assert again.id == asked.id  # still pending: the same request, nothing new to answer
    asked.requested_at -= timedelta(seconds=hangdump.STALL_WAIT_S + 1)
    fresh = diagnoses.request(session, run, run.attempts[0], "user", "alice")
    session.rollback()
    assert fresh.request != asked.request and published.get(key) == asked.request.encode()


def test_each_nodes_answer_is_kept_once_and_an_answer_to_nothing_is_dropped(session: Session) -> None:
    run = running_run(session)
    asked = diagnoses.request(session, run, run.attempts[0], "user")
    assert diagnoses.summary(asked)["status"] == "pending"
    answer(session, run, asked)
    answer(session, run, asked, "python_3")  # a redelivered entry: the first answer stays
    diagnoses.record_answer(session, run.id, {"request": "0" * 32, "node": "a", "dumps": [], "missing": {}})
    session.flush()
    assert session.scalar(select(func.count(Diagnosis.id))) == 1 and len(asked.answers) == 1
    found = diagnoses.summary(asked)
    assert found["status"] == "complete" and found["answered"] == 2
    assert found["headline"].startswith("no rank waits in a collective")
    assert [d["rank"] for d in diagnoses.raw(asked)["nodes"][0]["dumps"]] == [0, 1]


def test_a_run_keeps_its_newest_diagnoses_only(session: Session) -> None:
    run = running_run(session)
    for _ in range(diagnoses.KEEP_PER_RUN + 3):
        asked = diagnoses.request(session, run, run.attempts[0], "user")
        answer(session, run, asked)
    assert session.scalar(select(func.count(Diagnosis.id))) == diagnoses.KEEP_PER_RUN
    assert diagnoses.newest(session, run.id) is asked


def stall(session: Session, run: Run, seconds: float) -> None:
    """The run's last step was ``seconds`` ago, after its attempt started."""
    run.attempts[0].started_at = utcnow() - timedelta(seconds=seconds + 60)
    run.last_step, run.last_step_at = 3, utcnow() - timedelta(seconds=seconds)
    session.flush()


def test_the_watchdog_asks_the_ranks_first_then_fails_the_stall_with_what_they_said(session: Session) -> None:
    run = running_run(session, stall_timeout_s=4, max_attempts=1)
    stall(session, run, 5)
    watchdog.stop_stalled_and_overdue(session, DEFAULTS)
    asked = diagnoses.newest(session, run.id, "stall", 1)
    assert asked is not None and run.status == lifecycle.RUNNING  # the ranks have STALL_WAIT_S to answer
    watchdog.stop_stalled_and_overdue(session, DEFAULTS)
    assert diagnoses.newest(session, run.id) is asked and run.status == lifecycle.RUNNING

    answer(session, run, asked, "data_loading_2")
    watchdog.stop_stalled_and_overdue(session, DEFAULTS)
    assert run.status == lifecycle.FAILED
    assert run.status_reason.startswith("stalled: no step for 4 s (training.stall_timeout_s; last step 3); diagnosis: ")
    assert "rank 1 never entered all_reduce #" in run.status_reason and "no attempts left" in run.status_reason


def test_a_stall_whose_ranks_never_answer_still_ends_after_the_wait(session: Session) -> None:
    run = running_run(session, stall_timeout_s=4, max_attempts=2)
    stall(session, run, 5)
    watchdog.stop_stalled_and_overdue(session, DEFAULTS)
    asked = diagnoses.newest(session, run.id, "stall", 1)
    assert asked is not None
    later = timedelta(seconds=hangdump.STALL_WAIT_S + 1)  # time passes, without a step or an answer
    asked.requested_at, run.last_step_at = asked.requested_at - later, run.last_step_at - later  # type: ignore[operator]
    watchdog.stop_stalled_and_overdue(session, DEFAULTS)
    assert run.status == lifecycle.RESTARTING
    assert "diagnosis: ranks 0, 1 did not answer: no dump came" in run.status_reason


def test_a_run_without_a_stall_timeout_is_flagged_with_its_diagnosis_and_keeps_running(session: Session) -> None:
    """The default detection: 3 steps in the attempt's first 60 s (a mean step of 20 s), factor 2,
    floor 30 s: flagged after 40 s without a step, not after 35."""
    settings = Settings(stall_alert_factor=2, stall_alert_floor_s=30)
    run = running_run(session)
    run.attempts[0].first_step = 1
    stall(session, run, 35)
    run.attempts[0].started_at = run.last_step_at - timedelta(seconds=60)  # type: ignore[operator]
    watchdog.stop_stalled_and_overdue(session, settings)
    assert diagnoses.newest(session, run.id, "stall", 1) is None  # 35 s < 2 × 20 s
    run.last_step_at -= timedelta(seconds=10)  # type: ignore[operator]
    run.attempts[0].started_at -= timedelta(seconds=10)  # type: ignore[operator]  # the same run, 10 s later
    watchdog.stop_stalled_and_overdue(session, settings)
    asked = diagnoses.newest(session, run.id, "stall", 1)
    assert asked is not None and run.id not in alerts.holding(session, alerts.AlertKind.STALL)  # the ranks first
    answer(session, run, asked, "data_loading_2")
    watchdog.stop_stalled_and_overdue(session, settings)
    watchdog.stop_stalled_and_overdue(session, settings)  # once: an alert holds, no second event
    assert run.status == lifecycle.RUNNING and run.id in alerts.holding(session, alerts.AlertKind.STALL)
    (event,) = session.scalars(select(RunEvent).where(RunEvent.run_id == run.id, RunEvent.alert == "stall"))
    assert event.reason.startswith("stalled: no step for 45 s after step 3 (default detection: 40 s"), event.reason
    assert "rank 1 never entered all_reduce #" in event.reason and "training.stall_timeout_s" in event.reason

    run.last_step, run.last_step_at = 4, utcnow()  # a step came: the alert ends, silently
    watchdog.stop_stalled_and_overdue(session, settings)
    assert run.id not in alerts.holding(session, alerts.AlertKind.STALL) and run.status == lifecycle.RUNNING
    assert session.scalar(select(func.count(RunEvent.id)).where(RunEvent.alert == "stall")) == 1


def test_default_stall_detection_is_off_with_a_floor_of_zero(session: Session) -> None:
    run = running_run(session)
    stall(session, run, 10_000)
    watchdog.stop_stalled_and_overdue(session, Settings(stall_alert_floor_s=0))
    assert diagnoses.newest(session, run.id) is None and run.status == lifecycle.RUNNING


def test_live_viewers_hear_that_a_node_answered_without_its_dumps() -> None:
    data = {"attempt": 1, "node": "a", "request": "ab" * 16, "procs": 2, "dumps": [{"rank": 0}], "missing": {}}
    assert livefeed.decode_entry(streams.encode(streams.DIAGNOSIS, data), from_ranks=False) == (
        streams.DIAGNOSIS,
        {"attempt": 1, "node": "a", "request": "ab" * 16},
    )
