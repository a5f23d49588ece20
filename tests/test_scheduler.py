"""Placement: priority then age, best fit, and a reason for every run that must wait. Through the
data layer on a migrated database, with no processes."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend import lifecycle, runs
from backend.attempts import apply_report
from backend.models import Attempt, Node, Run, utcnow
from backend.scheduler import place_queued_runs
from backend.schemas import NodeOut
from testkit.stack import run_spec
from torchyard.spec import RunSpec


def submit(
    session: Session,
    name: str,
    procs: int,
    priority: int = 0,
    age_s: int = 0,
    nodes: int = 1,
    device: str = "cpu",
    allow_waiting: bool = False,
) -> Run:
    spec = run_spec(name=name, procs=procs, batch_size=procs * nodes * 8)
    spec["resources"].update(priority=priority, nodes=nodes, device=device)
    run = runs.create_run(session, RunSpec.model_validate(spec), None, allow_waiting_for_nodes=allow_waiting)
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
    too_big = submit(session, "too-big", procs=4, allow_waiting=True)  # the cluster may grow
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
    from cli.redis_server import RedisServer

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


def test_a_share_no_worker_claimed_is_sent_again_but_a_claimed_one_is_not(session: Session, tmp_path: Path) -> None:
    import redis

    from backend.scheduler import unclaimed_shares
    from cli.redis_server import RedisServer
    from torchyard import streams

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
        assert unclaimed_shares(session, client, older_than_s=120) == []  # not stale yet
        again = unclaimed_shares(session, client, older_than_s=30)
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
    apply_report(session, run.id, {"attempt": len(run.attempts), "node": node, "event": "exited", "status": status})
    session.flush()


def report_started(session: Session, run: Run, node: str) -> None:
    apply_report(session, run.id, {"attempt": len(run.attempts), "node": node, "event": "started"})
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
    for node in ("a", "b"):
        report_started(session, run, node)
    assert run.status == lifecycle.RUNNING

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


def gpu_node(node_id: str, count: int, slots: int = 2) -> Node:
    gpus = [{"index": i, "name": "NVIDIA H200", "memory_bytes": 141 << 30} for i in range(count)]
    return Node(id=node_id, host=f"h-{node_id}", slots=slots, devices="cpu,cuda", gpus=gpus)


def held_gpus(run: Run) -> list[int]:
    (share,) = run.attempts[-1].allocations
    return list(share.gpus)


def test_cuda_runs_get_gpus_of_their_own_count_no_cpu_slots_and_a_waiting_one_gets_those_freed(
    session: Session,
) -> None:
    session.add(gpu_node("g", 4, slots=2))
    first, second = (
        submit(session, "first", 2, age_s=30, device="cuda"),
        submit(session, "second", 2, age_s=20, device="cuda"),
    )
    cpu = submit(session, "cpu", 2, age_s=10)  # CPU slots are apart: a CUDA run takes none
    session.flush()

    placed = place_queued_runs(session)

    assert [(p.run_id, p.gpus) for p in placed] == [(first.id, (0, 1)), (second.id, (2, 3)), (cpu.id, ())]
    assert [list(a.slots for a in r.attempts[0].allocations) for r in (first, second, cpu)] == [[0], [0], [2]]
    assert "GPUs 0,1" in first.status_reason
    third = submit(session, "third", 2, device="cuda")
    session.flush()
    assert place_queued_runs(session) == []
    assert third.status == lifecycle.QUEUED
    assert "needs 2 GPUs on one node free at once; 0 node(s) have them free now" in third.status_reason
    described = {n.id: n for n in nodes_described(session)}["g"]
    assert [g.run_id for g in described.gpus] == [first.id, first.id, second.id, second.id]
    assert described.free_gpus == 0 and described.free_slots == 0

    lifecycle.transition(session, second, lifecycle.RUNNING)
    report_exit(session, second, "g", lifecycle.SUCCEEDED)
    (again,) = place_queued_runs(session)
    assert (again.run_id, again.gpus) == (third.id, (2, 3)), "the freed GPUs, not the ones first still holds"


def nodes_described(session: Session) -> list[NodeOut]:
    from backend.nodes import describe

    return describe(session)


def test_a_cuda_gang_gets_gpus_on_every_node_and_a_node_without_enough_free_gpus_is_skipped(session: Session) -> None:
    session.add_all([gpu_node("a", 2), gpu_node("b", 4), gpu_node("c", 4)])
    busy = submit(session, "busy", 3, age_s=10, device="cuda")
    gang = submit(session, "gang", 2, nodes=2, device="cuda")
    session.flush()

    placed = place_queued_runs(session)

    assert (placed[0].run_id, placed[0].node_id, placed[0].gpus) == (busy.id, "b", (0, 1, 2))
    # b has one GPU left: the gang takes the tightest nodes that fit, a (2) and c (4).
    assert sorted((p.node_id, p.gpus) for p in placed[1:]) == [("a", (0, 1)), ("c", (0, 1))]
    assert all(p.nnodes == 2 for p in placed[1:]) and gang.status == lifecycle.SCHEDULED


@pytest.mark.parametrize("ending", ["succeeded", "failed", "cancelled", "worker restarted", "stalled", "node lost"])
def test_gpus_are_given_back_however_the_run_ends(session: Session, ending: str) -> None:
    from backend import attempts
    from backend.scheduler import fail_runs_on_lost_nodes

    node = gpu_node("g", 2)
    session.add(node)
    run = submit(session, "r", 2, device="cuda")
    session.flush()
    place_queued_runs(session)
    report_started(session, run, "g")
    waiting = submit(session, "next", 2, device="cuda")
    session.flush()
    assert place_queued_runs(session) == []

    if ending == "cancelled":
        runs.request_cancel(session, run, "test")
        report_exit(session, run, "g", lifecycle.CANCELLED)
    elif ending == "worker restarted":  # what end_orphans reports for a killed worker's attempt
        apply_report(
            session, run.id, {"attempt": 1, "node": "g", "event": "exited", "status": "failed", "retryable": True}
        )
    elif ending == "stalled":  # the watchdog ends the attempt; its worker's exit report comes later
        attempts.end_attempt(session, run.attempts[0], lifecycle.FAILED)
        attempts.fail_or_restart(session, run, "stalled")
        assert place_queued_runs(session) == []  # the ranks are still being ended
        report_exit(session, run, "g", lifecycle.FAILED)
    elif ending == "node lost":
        node.status = "lost"
        fail_runs_on_lost_nodes(session, [node], timeout_s=15)
        node.status = "alive"
    else:
        report_exit(session, run, "g", ending)
    session.flush()

    # Free again: the next run takes them (a run restarting after its node failed it goes first: it is older).
    taker = run if run.status == lifecycle.RESTARTING else waiting
    assert [(p.run_id, p.gpus) for p in place_queued_runs(session)] == [(taker.id, (0, 1))]


@pytest.mark.parametrize(
    ("resources", "field", "words"),
    [
        ({"procs_per_node": 16}, "procs_per_node", "resources.procs_per_node (16): the largest node, big, has 4 slots"),
        (
            {"procs_per_node": 4, "nodes": 2},
            "nodes",
            "resources.nodes (2) × procs_per_node (4): only 1 node(s) have 4 slots: big",
        ),
        (
            {"procs_per_node": 3, "device": "cuda"},
            "procs_per_node",
            "resources.procs_per_node (3) (one process per GPU): the largest node, g, has 2 GPUs",
        ),
        (
            {"procs_per_node": 2, "nodes": 2, "device": "cuda"},
            "nodes",
            "resources.nodes (2) × procs_per_node (2): only 1 node(s) have 2 GPUs: g",
        ),
    ],
)
def test_a_size_no_registered_node_can_hold_is_refused_naming_the_field_and_the_largest_node_unless_nodes_may_join(
    session: Session, resources: dict, field: str, words: str
) -> None:
    from backend.errors import InvalidRequest

    session.add_all([Node(id="big", host="h1", slots=4), Node(id="small", host="h2", slots=2), gpu_node("g", 2)])
    session.flush()
    spec = run_spec(name="huge", procs=1, batch_size=96)
    spec["resources"].update(resources)
    with pytest.raises(InvalidRequest) as refused:
        runs.create_run(session, RunSpec.model_validate(spec), None)
    assert refused.value.loc == ["body", "resources", field] and words in refused.value.msg

    run = runs.create_run(session, RunSpec.model_validate(spec), None, allow_waiting_for_nodes=True)
    assert run.warnings == [f"{refused.value.msg}; it waits for such nodes to join (TORCHYARD_ALLOW_WAITING_FOR_NODES)"]
    assert run.status == lifecycle.QUEUED and run.status_reason == f"waiting: {run.warnings[0]}"
    assert "warning: " + words in runs.list_events(session, run.id)[0].reason


def test_with_no_node_registered_a_run_is_accepted_and_says_it_waits_for_one(session: Session) -> None:
    run = submit(session, "first", 64, device="cuda")
    assert run.status == lifecycle.QUEUED
    assert run.warnings == ["no worker node has registered yet: the run starts when one does (`torchyard worker`)"]
    assert (
        run.status_reason
        == "waiting: no worker node has registered yet: the run starts when one does (`torchyard worker`)"
    )
    session.add(Node(id="gone", host="h", slots=2, status="lost"))  # a lost node counts: it may come back
    session.flush()
    later = submit(session, "later", 2)
    assert later.warnings == [] and later.status_reason == "waiting: no worker node is alive"
