"""Multi-node runs across real network boundaries: every worker in its own network namespace
with its own address (tests/netns.py), Redis and the api reached over a bridge. Gang placement,
the c10d rendezvous on node rank 0's address, and a node whose network is cut mid-run."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests import netns
from tests.conftest import Client, RunningStack, run_spec
from tests.test_e2e import run_processes
from torchyard.local import Stack
from torchyard.procs import RedisServer, free_port, wait_for
from torchyard.settings import Settings, settings_env

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not netns.available(), reason="network namespaces need root and iproute2"),
]
SLOTS = (4, 2, 2)  # host-0 can take a 1 × 4 run; two 2 × 2 runs on three hosts must take turns


class Cluster:
    def __init__(self, tmp: Path, network: netns.Network, redis: RedisServer, stack: RunningStack) -> None:
        self.tmp, self.network, self.redis, self.stack = tmp, network, redis, stack
        self.client: Client = stack.client
        self.workers: dict[str, subprocess.Popen[bytes]] = {}

    def start_worker(self, index: int) -> None:
        host = self.network.hosts[index]
        node = f"host-{index}"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")},
            **settings_env(self.stack.settings),
            "TORCHYARD_NODE_ID": node,
            "TORCHYARD_NODE_HOST": host.address,
            "TORCHYARD_NODE_SLOTS": str(SLOTS[index]),
            "TORCHYARD_REDIS_URL": self.redis.url_at(self.network.gateway),
            "TORCHYARD_API_URL": f"http://{self.network.gateway}:{self.stack.settings.port}",
            "TORCHYARD_STATE_DIR": str(self.tmp / node),  # its own disk...
            "TORCHYARD_CHECKPOINT_ROOT": str(self.tmp / "shared-checkpoints"),  # ...and the shared one
            "GLOO_SOCKET_IFNAME": host.ifname,
        }
        self.workers[node] = subprocess.Popen(
            host.command(sys.executable, "-m", "torchyard.cli", "worker"), env=env, stdout=subprocess.DEVNULL
        )

    def node(self, node_id: str) -> dict[str, Any]:
        nodes = {n["id"]: n for n in self.client.http.get("/api/v1/nodes").json()}
        return dict(nodes.get(node_id, {}))

    def submit(self, name: str, nodes: int, procs: int, **training: Any) -> int:
        spec = run_spec(name=name, procs=procs, params={"hidden": 32}, **training)
        spec["resources"]["nodes"] = nodes
        response = self.client.http.post("/api/v1/runs", json=spec)
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    def mean_loss(self, run_id: int) -> list[float]:
        series = self.client.http.get(f"/api/v1/runs/{run_id}/metrics", params={"key": "loss"}).json()
        return [float(v) for v in series["aggregate"]["mean"]]


@contextmanager
def running_cluster(tmp: Path) -> Iterator[Cluster]:
    """The api, ingest and Redis on the bridge; one worker per host (``SLOTS``), each alive."""
    with netns.Network(len(SLOTS)) as network:
        redis = RedisServer(tmp / "redis", addresses=(network.gateway,)).start()
        settings = Settings(
            state_dir=tmp / "api",
            database_url=f"sqlite:///{tmp / 'torchyard.db'}",
            redis_url=redis.url,
            host="0.0.0.0",
            port=free_port(),
            admin_token=f"ty_test_{uuid.uuid4().hex}",
            heartbeat_s=0.5,
            node_timeout_s=5,
            scheduler_interval_s=0.5,
        )
        stack = Stack(settings, processes=("api", "ingest"))
        token = stack.start()
        running = Cluster(tmp, network, redis, RunningStack(stack, token))
        try:
            for index in range(len(SLOTS)):
                running.start_worker(index)
            for index in range(len(SLOTS)):
                node = f"host-{index}"
                wait_for(lambda: running.node(node).get("status") == "alive", 60, node)  # noqa: B023
            yield running
        finally:
            for proc in running.workers.values():
                proc.terminate()
            for proc in running.workers.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            stack.stop()
            redis.stop()


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


def two_gangs_on_three_nodes(cluster: Cluster) -> None:
    """Also a chaos scenario (``python -m benchmarks.chaos``)."""
    first = cluster.submit("gang-a", nodes=2, procs=2, steps=40)
    second = cluster.submit("gang-b", nodes=2, procs=2, steps=40)
    seen: dict[int, set[int]] = {first: set(), second: set()}
    waiting_reasons: list[str] = []

    def both_done() -> bool:
        runs = {r: cluster.client.run(r) for r in (first, second)}
        for run_id, run in runs.items():
            if run["status"] in ("scheduled", "running", "queued"):
                seen[run_id].add(len(run["node_ids"]) if run["status"] != "queued" else 0)
            if run["status"] == "queued":
                waiting_reasons.append(run["status_reason"])
            assert run["status"] not in ("failed", "cancelled"), run
        return all(r["status"] == "succeeded" for r in runs.values())

    wait_for(both_done, 240, "both gangs to finish", interval=0.2)
    assert all(sizes <= {0, 2} for sizes in seen.values()), seen
    assert any("needs 2 slots on each of 2 nodes" in r for r in waiting_reasons), waiting_reasons[-3:]


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
    wait_for(lambda: cluster.node(victim).get("status") == "alive", 60, f"{victim} to heartbeat again")
    wait_for(lambda: not run_processes(run_id), 60, "the cut node's ranks to be ended")
