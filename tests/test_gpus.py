"""GPUs as a resource on a real stack whose node is told it has four (TORCHYARD_NODE_GPUS=0,1,2,3,
trusted: this machine has none). The ranks never initialise CUDA: they print the
CUDA_VISIBLE_DEVICES the worker gave them, which the test reads back from the run's logs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from cli.wait import wait_for
from testkit.stack import RunningStack, sqlite_stack
from workers.rundirs import runs_dir

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]

# Holds its GPUs until the test drops a file named "release" next to it (then ends successfully).
HOLDS = """
import os, time
print(f"local_rank {os.environ['LOCAL_RANK']} sees CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}", flush=True)
while not os.path.exists("release"):
    time.sleep(0.1)
"""
SEES = re.compile(r"^local_rank (\d) sees CUDA_VISIBLE_DEVICES=([\d,]*)$")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(tmp_path_factory.mktemp("gpus"), node_gpus="0,1,2,3") as running:
        yield running


@pytest.fixture(scope="module")
def bundle(stack: RunningStack) -> str:
    return stack.client.upload({"hold.py": HOLDS})


def submit(stack: RunningStack, bundle: str, name: str, procs: int = 2) -> Any:
    spec = {
        "name": name,
        "workload": {"kind": "script", "bundle": bundle, "entry": "hold.py"},
        "resources": {"nodes": 1, "procs_per_node": procs, "device": "cuda"},
    }
    return stack.client.http.post("/api/v1/runs", json=spec)


def visible_devices(stack: RunningStack, run_id: int) -> dict[int, str]:
    """What each local rank of the run says it sees, once both have said it."""

    def seen() -> dict[int, str] | None:
        lines = stack.client.http.get(f"/api/v1/runs/{run_id}/logs", params={"limit": 10_000}).json()
        found = {int(m[1]): m[2] for m in (SEES.match(line["text"]) for line in lines) if m}
        return found if len(found) == 2 else None

    return wait_for(seen, 60, f"both ranks of run {run_id} to print their GPUs", interval=0.2)


def node(stack: RunningStack) -> dict[str, Any]:
    (only,) = stack.client.http.get("/api/v1/nodes").json()
    return dict(only)


def test_concurrent_cuda_runs_get_disjoint_gpus_and_a_waiting_one_reuses_those_given_back(
    stack: RunningStack, bundle: str
) -> None:
    assert [g["index"] for g in node(stack)["gpus"]] == [0, 1, 2, 3] and "cuda" in node(stack)["devices"]
    too_many = submit(stack, bundle, "eight", procs=8)
    assert too_many.status_code == 422, too_many.text
    assert f"the largest node, {stack.settings.node_id}, has 4 GPUs" in too_many.json()["detail"][0]["msg"]

    a, b = (submit(stack, bundle, name).json()["id"] for name in ("a", "b"))
    seen = {}
    for run_id in (a, b):
        stack.client.wait_status(run_id, {"running"})
        by_rank = visible_devices(stack, run_id)
        assert by_rank[0] == by_rank[1], "the ranks of one share see the same GPUs (LOCAL_RANK indexes them)"
        seen[run_id] = by_rank[0]
        assert stack.client.run(run_id)["attempts"][-1]["gpus"] == [[int(g) for g in by_rank[0].split(",")]]
    assert all(len(v.split(",")) == 2 for v in seen.values())
    assert set(seen[a].split(",")).isdisjoint(seen[b].split(",")), seen
    assert {g["run_id"] for g in node(stack)["gpus"]} == {a, b} and node(stack)["free_gpus"] == 0

    c = submit(stack, bundle, "c").json()["id"]
    reason = wait_for(
        lambda: "needs 2 GPUs" in (r := stack.client.run(c))["status_reason"] and r["status_reason"],
        30,
        "the scheduler's reason for the waiting run",
    )
    assert "needs 2 GPUs on one node free at once; 0 node(s) have them free now" in reason
    assert stack.client.run(c)["status"] == "queued"

    (runs_dir(stack.settings) / str(a) / "attempt-1" / "code" / "release").touch()  # a ends, successfully
    stack.client.wait_status(a, {"succeeded"})
    stack.client.wait_status(c, {"running"})
    assert visible_devices(stack, c)[0] == seen[a], "the waiting run got the GPUs the ended one gave back"

    for run_id in (b, c):
        assert stack.client.http.post(f"/api/v1/runs/{run_id}/cancel").status_code == 202
    for run_id in (b, c):
        stack.client.wait_status(run_id, {"cancelled"})
    wait_for(lambda: node(stack)["free_gpus"] == 4, 30, "every GPU free again after the cancels")
