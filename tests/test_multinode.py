"""Multi-node runs across real network boundaries: every worker in its own network namespace
with its own address (testkit/netns.py, testkit/cluster.py), Redis and the api reached over a bridge. Gang placement,
the c10d rendezvous on node rank 0's address, and a node whose network is cut mid-run."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cli.wait import wait_for
from testkit import netns
from testkit.cluster import Cluster, running_cluster, two_gangs_on_three_nodes
from testkit.require import needs
from testkit.stack import metric_rows, row_gaps, run_processes, run_spec

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    needs(*([] if netns.available() else ["iproute2's ip (apt-get install iproute2)"])),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("multinode")) as running:
        yield running


def test_two_nodes_of_two_match_one_node_of_four_step_by_step(cluster: Cluster) -> None:
    steps = 30
    single = cluster.submit("one-by-four", nodes=1, procs=4, steps=steps)
    gang = cluster.submit("two-by-two", nodes=2, procs=2, steps=steps)
    for run_id in (single, gang):
        cluster.client.wait_status(run_id, {"succeeded"}, timeout=180)

    placed = cluster.client.run(gang)
    assert sorted(placed["node_ids"]) == ["host-1", "host-2"], placed  # best fit leaves host-0 for bigger runs
    assert cluster.client.run(single)["node_ids"] == ["host-0"]
    events = cluster.client.http.get(f"/api/v1/runs/{gang}/events").json()
    assert "placed on 2 nodes" in events[1]["reason"]
    logs = cluster.client.http.get(f"/api/v1/runs/{gang}/logs", params={"limit": 5000}).json()
    assert {line["rank"] for line in logs} >= {0, 1, 2, 3}

    one, two = cluster.mean_loss(single), cluster.mean_loss(gang)
    assert len(one) == len(two) == steps
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True))
    assert worst <= 1e-4, f"2 × 2 differs from 1 × 4 by {worst:.2e} (relative) at worst"


def test_two_gangs_on_three_nodes_take_turns_and_never_hold_a_partial_allocation(cluster: Cluster) -> None:
    two_gangs_on_three_nodes(cluster)


def test_a_node_whose_network_is_cut_is_lost_and_the_run_resumes_on_other_nodes(cluster: Cluster) -> None:
    steps, every = 800, 100
    run_id = cluster.submit("survives-a-cut", nodes=2, procs=2, steps=steps, checkpoint_every=every)
    wait_for(lambda: cluster.client.run(run_id)["last_step"] > every + 20, 180, "a checkpoint to be written")
    gang = cluster.client.run(run_id)["node_ids"]
    victim = sorted(gang)[-1]
    host = cluster.network.hosts[int(victim.split("-")[1])]
    host.cut()
    try:
        restarted = cluster.client.wait_status(run_id, {"restarting", "scheduled", "running"}, timeout=5)
        wait_for(lambda: cluster.client.run(run_id)["attempt_count"] == 2, 60, "a second attempt on the nodes left")
        second = cluster.client.run(run_id)
        assert victim not in second["node_ids"] and len(second["node_ids"]) == 2, (restarted, second)
    finally:
        host.reconnect()  # the cut node comes back: its worker must end the ranks it left hanging
    done = cluster.client.wait_status(run_id, {"succeeded"}, timeout=240)
    assert done["attempt_count"] == 2
    first, second_attempt = done["attempts"]
    assert first["first_step"] == 1 and victim in first["node_ids"] and first["status"] == "failed"
    assert second_attempt["first_step"] % every == 1 and second_attempt["first_step"] > every  # resumed there

    events = cluster.client.http.get(f"/api/v1/runs/{run_id}/events").json()
    lost = next(e for e in events if e["to_status"] == "restarting")
    assert f"node {victim} lost" in lost["reason"]
    logs = cluster.client.http.get(f"/api/v1/runs/{run_id}/logs", params={"limit": 10000}).json()
    assert any("resumed from the checkpoint at step" in line["text"] and line["attempt"] == 2 for line in logs)
    series = cluster.client.http.get(f"/api/v1/runs/{run_id}/metrics", params={"key": "loss"}).json()
    assert {rank: len(points["step"]) for rank, points in series["ranks"].items()} == {
        str(r): steps for r in range(4)
    }  # one value per rank and step: replayed steps count once
    assert (
        row_gaps(metric_rows(cluster.stack.settings, run_id), steps, ranks=4, keys={"loss"}) == []
    )  # rows: none twice
    wait_for(lambda: cluster.node(victim).get("status") == "alive", 60, f"{victim} to heartbeat again")
    wait_for(
        lambda: not run_processes(run_id, cluster.stack.settings.checkpoints), 60, "the cut node's ranks to be ended"
    )


@pytest.mark.parametrize(
    ("hang_in", "named"),
    [
        ("data_loading", "rank 1 never entered all_reduce #"),  # stuck in Python: its frame follows
        ("skip_collective", "rank 1 never entered all_reduce #"),
        ("other_collective", "rank 0 in all_reduce #1 (group 1), rank 1 in broadcast #1 (group 1)"),
    ],
)
def test_a_hang_across_nodes_is_diagnosed_from_both_nodes_dumps(cluster: Cluster, hang_in: str, named: str) -> None:
    spec = run_spec(name=f"hangs-across-{hang_in}", workload="fail", procs=1, steps=200, batch_size=16)
    spec["resources"]["nodes"] = 2
    spec["workload"]["params"] = {"at_step": 4, "hang": True, "rank": 1, "hang_in": hang_in}
    spec["training"].update(stall_timeout_s=4, max_attempts=1)
    response = cluster.client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    run_id = int(response.json()["id"])
    failed = cluster.client.wait_status(run_id, {"failed"}, timeout=120)
    found = cluster.client.http.get(f"/api/v1/runs/{run_id}/diagnosis").json()
    assert (found["status"], found["nodes"], found["nodes_answered"], found["answered"]) == ("complete", 2, 2, 2)
    assert found["headline"].startswith(named), found["headline"]
    if hang_in == "data_loading":
        assert "rank 1 is at workloads.py:" in found["headline"]
    assert found["headline"] in failed["status_reason"]
