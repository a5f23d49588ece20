"""Several worker hosts on one machine: each worker in its own network namespace with its own address
(``testkit/netns.py``), Redis and the api reached over a bridge; the two-gangs-on-three-nodes scenario
that ``tests/test_multinode.py`` runs once and ``benchmarks/chaos.py`` repeats."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cli.local import Stack
from cli.redis_server import RedisServer
from cli.wait import wait_for
from testkit import netns
from testkit.stack import Client, RunningStack, mean_loss, submit_on_nodes
from torchyard.net import free_port
from torchyard.settings import Settings, settings_env

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
            "TORCHYARD_CHECKPOINT_ROOT": str(self.tmp / "shared-checkpoints"),  # ...and the shared ones
            "TORCHYARD_DATASET_ROOT": str(self.stack.settings.datasets),  # where the api stores datasets
            "GLOO_SOCKET_IFNAME": host.ifname,
        }
        self.workers[node] = subprocess.Popen(
            host.command(sys.executable, "-m", "cli.main", "worker"), env=env, stdout=subprocess.DEVNULL
        )

    def node(self, node_id: str) -> dict[str, Any]:
        nodes = {n["id"]: n for n in self.client.http.get("/api/v1/nodes").json()}
        return dict(nodes.get(node_id, {}))

    def submit(self, name: str, nodes: int, procs: int, **training: Any) -> int:
        return submit_on_nodes(self.client, name, nodes, procs, **training)

    def mean_loss(self, run_id: int) -> list[float]:
        return mean_loss(self.client, run_id)


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
