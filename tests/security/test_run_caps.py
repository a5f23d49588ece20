"""A run's caps on a live stack (README "Limits"): a fork bomb, a disk filler and a memory hog,
each a member's submitted script, are stopped at their cap and fail saying which cap, while
another member's run trains beside them and succeeds with every step stored once; the node's
slots all come back."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cli.wait import wait_for
from testkit.stack import RunningStack, metric_rows, sqlite_stack

pytestmark = [
    pytest.mark.stack,
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="caps are held by a root worker's control groups"),
]
PIDS, DISK = 128, 64 << 20

FORK_BOMB = """
import os
r, w = os.pipe()  # each child waits on it: they all end when the bomb does
n = 0
try:
    while True:
        if os.fork() == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        n += 1
except OSError as exc:
    raise RuntimeError(f"fork bomb stopped after {n} children: {exc.strerror}") from None
"""
DISK_FILLER = """
import os, time
with open("filler.bin", "wb") as f:
    for _ in range(300):  # 300 MiB, really written
        f.write(os.urandom(1 << 20))
        f.flush()
print("filled", flush=True)
while True:
    time.sleep(1)  # until the watch ends the run
"""
MEMORY_HOG = """
blocks = [bytearray(16 << 20) for _ in range(128)]  # 2 GiB, touched
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(tmp_path_factory.mktemp("caps"), run_max_pids=PIDS, run_max_disk_bytes=DISK) as running:
        yield running


def test_each_hog_stops_at_its_cap_and_the_victim_trains_on(stack: RunningStack) -> None:
    client = stack.client
    victim = client.submit(name="victim", procs=1, steps=300)["id"]
    bomb = client.submit_script("bomb", "bomb.py", FORK_BOMB)["id"]
    filler = client.submit_script("filler", "filler.py", DISK_FILLER)["id"]
    spec = {
        "name": "hog",
        "workload": {"kind": "script", "bundle": client.upload({"hog.py": MEMORY_HOG}), "entry": "hog.py"},
        "resources": {"nodes": 1, "procs_per_node": 1, "memory_limit_bytes": 768 << 20},
    }
    response = client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    hog = response.json()["id"]

    reasons = {
        run_id: client.wait_status(run_id, {"failed"}, timeout=180)["status_reason"] for run_id in (bomb, filler, hog)
    }
    assert reasons[bomb].startswith(f"the run reached its cap of {PIDS} processes and threads"), reasons[bomb]
    assert "fork bomb stopped after" in reasons[bomb]  # the script's own last word follows
    assert reasons[filler].startswith("the run's files passed its disk cap"), reasons[filler]
    assert reasons[hog].startswith("the run passed its memory cap of 768 MiB"), reasons[hog]

    client.wait_status(victim, {"succeeded"}, timeout=180)
    rows = metric_rows(stack.settings, victim)
    losses = [count for (_attempt, _rank, key, _step), count in rows.items() if key == "loss"]
    assert len(losses) == 300 and set(losses) == {1}, "each step of the victim stored exactly once"

    [node] = client.http.get("/api/v1/nodes").json()
    assert node["caps"].startswith("processes and memory capped per run by cgroup v"), node  # the cluster page's

    def slots_free() -> bool:
        nodes = client.http.get("/api/v1/nodes").json()
        return all(node["free_slots"] == node["slots"] for node in nodes)

    wait_for(slots_free, 30, "every slot given back")
