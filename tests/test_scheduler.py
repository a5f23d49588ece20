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


def submit(session: Session, name: str, procs: int, priority: int = 0, age_s: int = 0, nodes: int = 1) -> Run:
    spec = run_spec(name=name, procs=procs, batch_size=procs * nodes * 8)
    spec["resources"].update(priority=priority, nodes=nodes)
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
    assert waits.status == lifecycle.QUEUED and "0 node(s) have them free now" in waits.status_reason


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
        client.set(streams.attempt_claim_key(claimed.id, 1, 0), "n1")
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


def allocations_of(session: Session, run: Run) -> list[tuple[str, int]]:
    return sorted((a.node_id, a.node_rank) for attempt in run.attempts for a in attempt.allocations)


def report_exit(session: Session, run: Run, node: str, status: str) -> None:
    from backend.ingest import apply_report

    apply_report(session, run.id, {"attempt": len(run.attempts), "node": node, "event": "exited", "status": status})
    session.flush()


def test_a_gang_gets_all_its_nodes_in_one_pass_or_none_and_never_a_partial_allocation(session: Session) -> None:
    session.add_all([Node(id=n, host=f"10.0.0.{i}", slots=2) for i, n in enumerate(("a", "b", "c"), start=1)])
    first = submit(session, "first", procs=2, nodes=2, age_s=10)
    second = submit(session, "second", procs=2, nodes=2)
    session.flush()

    placed = place_queued_runs(session)

    assert [(p.run_id, p.node_rank, p.nnodes) for p in placed] == [(first.id, 0, 2), (first.id, 1, 2)]
    rank0 = next(p for p in placed if p.node_rank == 0)
    assert {p.rdzv_host for p in placed} == {f"10.0.0.{'abc'.index(rank0.node_id) + 1}"}  # rank 0's address
    assert len(allocations_of(session, first)) == 2 and allocations_of(session, second) == []
    assert second.status == lifecycle.QUEUED
    reason = second.status_reason
    assert "needs 2 slots on each of 2 nodes" in reason and "1 node(s) have them free now" in reason

    # Each node of the gang frees its slots when it reports; the run succeeds when all have.
    lifecycle.transition(session, first, lifecycle.RUNNING)
    done, still = placed[0].node_id, placed[1].node_id
    report_exit(session, first, done, lifecycle.SUCCEEDED)
    assert first.status == lifecycle.RUNNING  # the other node still trains
    again = place_queued_runs(session)
    assert {p.node_id for p in again} == {"abc".replace(still, "")[0], "abc".replace(still, "")[1]}
    assert second.status == lifecycle.SCHEDULED
    report_exit(session, first, still, lifecycle.SUCCEEDED)
    assert first.status == lifecycle.SUCCEEDED


def test_the_first_node_of_a_gang_to_fail_ends_the_attempt_and_the_rest_only_free_their_slots(session: Session) -> None:
    session.add_all([Node(id="a", host="h1", slots=2), Node(id="b", host="h2", slots=2)])
    run = submit(session, "gang", procs=2, nodes=2)
    session.flush()
    place_queued_runs(session)
    lifecycle.transition(session, run, lifecycle.RUNNING)

    report_exit(session, run, "a", lifecycle.FAILED)

    assert run.status == lifecycle.FAILED and run.attempts[0].status == lifecycle.FAILED
    assert session.info["ended_attempts"] == [(run.id, 1)]  # published on commit: node b stops
    from backend.nodes import free_slots

    assert free_slots(session) == {"a": 2, "b": 0}  # b's ranks are still winding down
    report_exit(session, run, "b", lifecycle.FAILED)
    assert free_slots(session) == {"a": 2, "b": 2} and run.status == lifecycle.FAILED


def test_a_waiting_gang_holds_slots_so_smaller_runs_behind_it_cannot_starve_it(session: Session) -> None:
    session.add_all([Node(id="a", host="h1", slots=2), Node(id="b", host="h2", slots=4)])
    busy = submit(session, "busy", procs=2, age_s=30)
    session.flush()
    assert [p.node_id for p in place_queued_runs(session)] == ["a"]
    big = submit(session, "big", procs=2, nodes=2, age_s=20)
    small = submit(session, "small", procs=2, age_s=10)
    gap = submit(session, "gap", procs=2, age_s=5)
    session.flush()

    placed = place_queued_runs(session)

    # b has 4 free slots: 2 are held for the big run, so one small run fills the other 2, not both.
    assert [p.run_id for p in placed] == [small.id] and placed[0].node_id == "b"
    assert big.status == lifecycle.QUEUED and "holding 2 slots on b, a for it" in big.status_reason
    assert gap.status == lifecycle.QUEUED and "hold slots for an earlier waiting run" in gap.status_reason

    lifecycle.transition(session, busy, lifecycle.RUNNING)
    report_exit(session, busy, "a", lifecycle.SUCCEEDED)
    placed = place_queued_runs(session)
    assert [(p.run_id, p.node_id) for p in placed] == [(big.id, "a"), (big.id, "b")]
    assert gap.status == lifecycle.QUEUED  # b is full now: its turn comes when a slot frees


def test_a_higher_priority_gang_goes_before_older_small_runs(session: Session) -> None:
    session.add_all([Node(id="a", host="h1", slots=2), Node(id="b", host="h2", slots=2)])
    old = submit(session, "old", procs=2, age_s=60)
    urgent = submit(session, "urgent", procs=2, nodes=2, priority=5)
    session.flush()
    assert {p.run_id for p in place_queued_runs(session)} == {urgent.id}
    assert old.status == lifecycle.QUEUED
