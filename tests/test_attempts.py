"""Attempt outcomes (backend/attempts.py) through the data layer on a migrated database and a real
Redis, with no other processes: reports in any order, shares that hold slots until their worker
says they ended (or surely did), and the cancels nothing else would finish."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy.orm import Session

from backend import attempts, lifecycle, runs
from backend.attempts import apply_report, reconcile
from backend.models import Node, Run, utcnow
from backend.nodes import free_slots
from backend.scheduler import place_queued_runs
from cli.redis_server import RedisServer
from testkit.stack import run_spec
from torchyard import streams
from torchyard.settings import Settings
from torchyard.spec import RunSpec


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


def placed_run(session: Session, nodes: int = 1, **training: Any) -> Run:
    session.add_all([Node(id=n, host=f"h-{n}", slots=2) for n in "ab"[:nodes]])
    spec = run_spec(procs=2, batch_size=16 * nodes, **training)
    spec["resources"]["nodes"] = nodes
    run = runs.create_run(session, RunSpec.model_validate(spec), None)
    session.flush()
    assert len(place_queued_runs(session)) == nodes
    return run


def report(session: Session, run: Run, node: str, event: str, attempt: int = 1, **fields: object) -> None:
    apply_report(session, run.id, {"attempt": attempt, "node": node, "event": event, **fields})
    session.flush()


def test_a_stalled_attempts_late_exit_frees_its_slots_after_the_run_failed(session: Session) -> None:
    run = placed_run(session, max_attempts=1)
    report(session, run, "a", "started")
    attempts.end_attempt(session, run.attempts[0], lifecycle.FAILED)  # the watchdog
    attempts.fail_or_restart(session, run, "stalled")
    assert run.status == lifecycle.FAILED
    assert free_slots(session) == {"a": 0}  # its ranks are still being ended

    report(session, run, "a", "exited", status=lifecycle.FAILED, reason="the attempt ended elsewhere")

    share = run.attempts[0].allocations[0]
    assert free_slots(session) == {"a": 2} and share.exit_status == lifecycle.FAILED
    assert run.status == lifecycle.FAILED  # the late report changes no state


def test_a_share_that_never_started_holds_nothing_once_its_attempt_ended(session: Session) -> None:
    run = placed_run(session, nodes=2)
    report(session, run, "a", "started")
    report(session, run, "a", "exited", status=lifecycle.FAILED, reason="boom")
    assert run.status == lifecycle.FAILED
    assert free_slots(session) == {"a": 2, "b": 2}  # b never launched: nothing there to wind down
    # Its worker claimed it late and reports anyway: the exit is recorded, nothing else moves.
    report(session, run, "b", "exited", status=lifecycle.FAILED, reason="the attempt ended before it started")
    assert {a.node_id: a.exit_status for a in run.attempts[0].allocations} == {"a": "failed", "b": "failed"}


def test_reconcile_frees_a_share_whose_exit_report_never_comes_once_its_grace_is_over(
    session: Session, client: redis.Redis, tmp_path: Path
) -> None:
    settings = Settings(state_dir=tmp_path, cancel_grace_s=2)
    run = placed_run(session)
    report(session, run, "a", "started")
    attempt = run.attempts[0]
    attempts.end_attempt(session, attempt, lifecycle.FAILED)
    attempts.fail_or_restart(session, run, "stalled")
    reconcile(session, client, settings)
    assert free_slots(session) == {"a": 0}  # within the grace: its worker is still ending it

    attempt.ended_at = utcnow() - timedelta(seconds=attempts.wind_down_s(settings, run.run_spec) + 1)
    reconcile(session, client, settings)
    assert free_slots(session) == {"a": 2}


def test_a_cancel_no_worker_will_ever_see_completes_and_a_held_one_waits(
    session: Session, client: redis.Redis, tmp_path: Path
) -> None:
    settings = Settings(state_dir=tmp_path)
    session.add(Node(id="b", host="h-b", slots=2))
    run = placed_run(session)  # on a (tightest fit first: both free, a before b)
    held = runs.create_run(session, RunSpec.model_validate(run_spec(procs=2, batch_size=16)), None)
    session.flush()
    place_queued_runs(session)
    for r in (run, held):
        runs.request_cancel(session, r, "cancelled by test")
        r.attempts[0].created_at = utcnow() - timedelta(seconds=attempts.CLAIM_GRACE_S + 1)
    node = held.attempts[0].allocations[0].node_id
    client.set(streams.attempt_claim_key(held.id, 1, 0), node)
    client.set(streams.node_key(node), "{}")  # that node's worker heartbeats: it will report

    reconcile(session, client, settings)

    assert run.status == lifecycle.CANCELLED and "no live worker" in run.status_reason
    assert run.status_reason.startswith("cancelled by test; "), "why it was cancelled stays first"
    assert held.status == lifecycle.CANCELLING
    client.delete(streams.node_key(node))  # its worker died: nothing is left to end the run
    reconcile(session, client, settings)
    assert held.status == lifecycle.CANCELLED
    assert free_slots(session) == {"a": 2, "b": 2}


def test_a_cancelling_run_whose_attempt_already_ended_is_cancelled(
    session: Session, client: redis.Redis, tmp_path: Path
) -> None:
    run = placed_run(session)
    report(session, run, "a", "started")
    attempts.end_attempt(session, run.attempts[0], lifecycle.FAILED)  # ended while still running
    runs.request_cancel(session, run, "cancelled by test")
    reconcile(session, client, Settings(state_dir=tmp_path))
    assert run.status == lifecycle.CANCELLED


def test_a_cancel_the_api_never_issued_restarts_the_run_instead_of_stranding_it(session: Session) -> None:
    run = placed_run(session, max_attempts=2)
    report(session, run, "a", "started")
    report(session, run, "a", "exited", status=lifecycle.CANCELLED, reason="every process was ended on cancel")
    assert run.status == lifecycle.RESTARTING and "cancel nobody asked the api for" in run.status_reason


def test_asking_again_to_cancel_a_cancelling_run_changes_nothing(session: Session) -> None:
    run = placed_run(session)
    runs.request_cancel(session, run, "first")
    runs.request_cancel(session, run, "second")
    assert run.status == lifecycle.CANCELLING and run.status_reason == "first"
    run.status = lifecycle.CANCELLED
    with pytest.raises(lifecycle.IllegalTransition):
        runs.request_cancel(session, run, "third")
