"""Placement: priority then age, best fit, and a reason for every run that must wait. Through the
data layer on a migrated database, with no processes."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend import lifecycle, runs
from backend.db import make_engine
from backend.migrate import upgrade
from backend.models import Attempt, Node, Run, utcnow
from backend.scheduler import place_queued_runs
from tests.conftest import run_spec
from torchyard.spec import RunSpec


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    with Session(engine) as s:
        yield s
    engine.dispose()


def submit(session: Session, name: str, procs: int, priority: int = 0, age_s: int = 0) -> Run:
    spec = run_spec(name=name, procs=procs, batch_size=procs * 8)
    spec["resources"]["priority"] = priority
    run = runs.create_run(session, RunSpec.model_validate(spec), None)
    run.created_at = utcnow() - timedelta(seconds=age_s)
    return run


def test_higher_priority_then_older_runs_are_placed_first_on_the_best_fitting_node(session: Session) -> None:
    session.add_all([Node(id="big", host="h1", slots=4), Node(id="small", host="h2", slots=2)])
    old = submit(session, "old", procs=2, age_s=60)
    new = submit(session, "new", procs=2, age_s=0)
    urgent = submit(session, "urgent", procs=2, priority=10, age_s=0)
    session.flush()

    placed = place_queued_runs(session)

    assert [p.run_id for p in placed] == [urgent.id, old.id, new.id]
    # Best fit: the first 2-slot run takes the 2-slot node, keeping the 4-slot node whole.
    assert placed[0].node_id == "small"
    assert {p.node_id for p in placed[1:]} == {"big"}
    assert all(r.status == lifecycle.SCHEDULED for r in (old, new, urgent))


def test_a_run_that_fits_nowhere_waits_with_the_reason(session: Session) -> None:
    session.add(Node(id="n1", host="h", slots=2))
    too_big = submit(session, "too-big", procs=4)
    fits = submit(session, "fits", procs=2)
    waits = submit(session, "waits", procs=2)
    session.flush()

    placed = place_queued_runs(session)

    assert [p.run_id for p in placed] == [fits.id]
    assert (
        too_big.status == lifecycle.QUEUED
        and "needs 4 slots" in too_big.status_reason
        and "has 2" in too_big.status_reason
    )
    assert waits.status == lifecycle.QUEUED and "most free is 0 on n1" in waits.status_reason


def test_no_alive_node_means_waiting(session: Session) -> None:
    session.add(Node(id="gone", host="h", slots=8, status="lost"))
    run = submit(session, "r", procs=1)
    session.flush()
    assert place_queued_runs(session) == []
    assert run.status_reason == "waiting: no worker node is alive"


def test_every_state_change_goes_through_the_table(session: Session) -> None:
    run = submit(session, "r", procs=1)
    session.flush()
    with pytest.raises(lifecycle.IllegalTransition, match="is queued; it cannot become succeeded"):
        lifecycle.transition(session, run, lifecycle.SUCCEEDED)
    lifecycle.transition(session, run, lifecycle.CANCELLED, "test")
    assert run.ended_at is not None
    assert [e.to_status for e in runs.list_events(session, run.id)] == ["queued", "cancelled"]


def test_a_node_the_database_knows_but_redis_never_heard_of_is_lost(session: Session, tmp_path: Path) -> None:
    from backend.nodes import sync_from_heartbeats
    from torchyard.procs import RedisServer

    session.add(Node(id="ghost", host="h", slots=4))
    session.flush()
    server = RedisServer(tmp_path / "redis").start()
    try:
        import redis

        lost = sync_from_heartbeats(session, redis.Redis.from_url(server.url))
    finally:
        server.stop()
    assert [n.id for n in lost] == ["ghost"]
    assert session.get(Node, "ghost").status == "lost"  # type: ignore[union-attr]


def test_a_placement_no_worker_claimed_is_sent_again_but_a_claimed_one_is_not(session: Session, tmp_path: Path) -> None:
    import redis

    from backend.scheduler import unclaimed_placements
    from torchyard import streams
    from torchyard.procs import RedisServer

    session.add(Node(id="n1", host="h", slots=4))
    lost, claimed = submit(session, "lost", procs=1), submit(session, "claimed", procs=1)
    session.flush()
    assert len(place_queued_runs(session)) == 2
    for attempt in session.scalars(select(Attempt)):
        attempt.created_at = utcnow() - timedelta(seconds=60)
    server = RedisServer(tmp_path / "redis").start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set(streams.attempt_claim_key(claimed.id, 1), "n1")
        assert unclaimed_placements(session, client, older_than_s=120) == []  # not stale yet
        again = unclaimed_placements(session, client, older_than_s=30)
    finally:
        server.stop()
    assert [(p.run_id, p.attempt, p.node_id) for p in again] == [(lost.id, 1, "n1")]


def test_a_lost_node_restarts_its_runs_until_their_attempts_run_out(session: Session) -> None:
    from backend.scheduler import fail_runs_on_lost_nodes

    node = Node(id="n1", host="h", slots=4)
    session.add(node)
    spec = run_spec(name="r", procs=2, batch_size=16)
    spec["training"]["max_attempts"] = 2
    run = runs.create_run(session, RunSpec.model_validate(spec), None)
    session.flush()

    for attempt in (1, 2):
        node.status = "alive"
        assert [p.attempt for p in place_queued_runs(session)] == [attempt]
        node.status = "lost"
        fail_runs_on_lost_nodes(session, [node], timeout_s=15)
    session.refresh(run)
    events = [(e.to_status, e.reason) for e in runs.list_events(session, run.id)]
    assert [s for s, _ in events] == ["queued", "scheduled", "restarting", "scheduled", "failed"]
    assert "attempt 2 of 2" in events[2][1] and "no attempts left" in events[-1][1]
