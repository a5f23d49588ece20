"""Hang diagnosis through the real stack (api, scheduler, ingest, worker, torchrun, Gloo ranks): a run
that hangs one way (``workers/runtime/hangs.py``) is diagnosed by name, from its ranks' Flight
Recorders and stacks, before the watchdog ends the stalled attempt (the watchdog waits for the
ranks' answer: a complete diagnosis named in the failure reason is one made first; how long after
the last step it came is printed, not bounded: the ranks share 2 cores with other tests); a user's
"diagnose" on a running run answers in seconds."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import psutil
import pytest

from cli.redis_server import RedisServer
from cli.wait import wait_for
from testkit.stack import Client, RunningStack, run_processes, run_spec, start_stack

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]
STALL_S = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, module_pg_url: str) -> Iterator[RunningStack]:
    """One stack on PostgreSQL (the comparison and the data layer are tested on SQLite apart)."""
    tmp = tmp_path_factory.mktemp("diagnosis")
    redis = RedisServer(tmp / "redis").start()
    running = start_stack(tmp, module_pg_url, redis)
    yield running
    running.stack.stop()
    redis.stop()


def hung_spec(name: str, procs: int, **params: Any) -> dict[str, Any]:
    spec = run_spec(name=name, workload="fail", procs=procs, steps=200, batch_size=12 * procs)
    spec["workload"]["params"] = {"at_step": 4, "hang": True, **params}
    return spec


def submit(client: Client, spec: dict[str, Any]) -> int:
    response = client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def last_step_time(stack: RunningStack, run_id: int) -> float:
    """When the last step was logged (the ranks' clocks: this node's)."""
    series = stack.client.http.get(f"/api/v1/runs/{run_id}/metrics", params={"key": "loss"}).json()
    return max(max(points["ts"]) for points in series["ranks"].values())


def utc(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def stalled_and_diagnosed(stack: RunningStack, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs a spec that hangs to its failure by the watchdog; returns the failed run and its
    diagnosis, which was complete before the run ended (the api's clock for both)."""
    spec["training"].update(stall_timeout_s=STALL_S, max_attempts=1)
    run_id = submit(stack.client, spec)
    failed = stack.client.wait_status(run_id, {"failed"}, timeout=90)
    found = stack.client.http.get(f"/api/v1/runs/{run_id}/diagnosis").json()
    assert found["trigger"] == "stall" and found["status"] == "complete", found
    assert utc(found["answered_at"]) <= utc(failed["ended_at"]), (found["answered_at"], failed["ended_at"])
    took = datetime.fromisoformat(found["answered_at"]).timestamp() - last_step_time(stack, run_id)
    print(f"{spec['name']}: diagnosed {took:.1f} s after the last step: {found['headline']}")
    _gone, alive = psutil.wait_procs(run_processes(run_id, stack.settings.checkpoints), timeout=15)
    assert not alive, f"left running: {alive}"
    return failed, found


def test_a_rank_that_skips_a_collective_is_named_in_the_failure_reason(stack: RunningStack) -> None:
    failed, found = stalled_and_diagnosed(stack, hung_spec("skips", 3, rank=1, hang_in="skip_collective"))
    assert found["headline"].startswith("rank 1 never entered all_reduce #1 (group 1) that ranks 0, 2 wait in")
    assert "stalled: no step for 4 s" in failed["status_reason"]
    assert f"diagnosis: {found['headline']}" in failed["status_reason"]
    assert [r["state"] for r in found["ranks"]] == ["collective"] * 3


def test_a_rank_in_another_collective_is_named_as_a_mismatch(stack: RunningStack) -> None:
    failed, found = stalled_and_diagnosed(stack, hung_spec("mismatch", 2, rank=1, hang_in="other_collective"))
    assert found["headline"] == "rank 0 in all_reduce #1 (group 1), rank 1 in broadcast #1 (group 1)"
    assert found["findings"][0]["kind"] == "mismatch"
    assert found["headline"] in failed["status_reason"]


def test_a_rank_sleeping_in_its_data_loading_is_named_with_its_frame(stack: RunningStack) -> None:
    failed, found = stalled_and_diagnosed(stack, hung_spec("slow-data", 2, rank=1, hang_in="data_loading"))
    assert found["headline"] in failed["status_reason"]
    head = found["headline"]
    assert (
        head.startswith("rank 1 never entered all_reduce #")
        and "that rank 0 waits in; rank 1 is at workloads.py:" in head
    )
    assert "in __getitems__ (time.sleep(1.0))" in head
    stuck = found["ranks"][1]
    assert stuck["state"] == "python" and [f["func"] for f in stuck["frames"]][-2:] == ["batches", "__getitems__"]
    assert found["ranks"][0]["state"] == "collective" and found["ranks"][0]["waiting_s"] > 0


def test_a_user_diagnoses_a_running_run_and_downloads_the_dumps(stack: RunningStack) -> None:
    alice, bob = (member(stack, name) for name in ("alice", "bob"))
    run_id = submit(alice, hung_spec("stuck", 2, rank=1))  # rank 1 waits in Python at step 4; no watchdog
    assert bob.http.post(f"/api/v1/runs/{run_id}/diagnose").status_code == 403
    assert alice.http.get(f"/api/v1/runs/{run_id}/diagnosis").status_code == 404

    def named() -> dict[str, Any] | None:
        asked = alice.http.post(f"/api/v1/runs/{run_id}/diagnose")
        if asked.status_code == 409:  # not running yet
            return None
        assert asked.status_code == 202, asked.text
        found = wait_for(lambda: done(alice, run_id), 15, "the ranks' answers", interval=0.2)
        # Asked while rank 1 was still on its way to step 4 (under load, in its first Redis connect,
        # say), a diagnosis names where it was then: ask again until one names the hang.
        headline = found["headline"]
        return found if headline.startswith("rank 1 never entered all_reduce #") and "hangs.py" in headline else None

    found = wait_for(named, 60, "a diagnosis naming rank 1", interval=0.5)
    assert found["trigger"] == "user" and found["requested_by"] == "alice"
    assert "rank 1 is at hangs.py:" in found["headline"] and "threading.Event().wait()" in found["headline"]
    download = alice.http.get(f"/api/v1/runs/{run_id}/diagnosis/dumps")
    assert download.status_code == 200 and "attachment" in download.headers["content-disposition"]
    (node,) = download.json()["nodes"]
    ranks = sorted(d["rank"] for d in node["dumps"])
    assert ranks == [0, 1] and all(d["flight_recorder"]["entries"] for d in node["dumps"])

    assert alice.http.post(f"/api/v1/runs/{run_id}/cancel").status_code == 202
    alice.wait_status(run_id, {"cancelled"}, timeout=60)
    refused = alice.http.post(f"/api/v1/runs/{run_id}/diagnose")
    assert refused.status_code == 409 and "only a running run can be diagnosed" in refused.json()["detail"]


def member(stack: RunningStack, name: str) -> Client:
    response = stack.client.http.post("/api/v1/tokens", json={"name": name, "role": "member"})
    assert response.status_code == 201, response.text
    return Client(stack.url, response.json()["token"])


def done(client: Client, run_id: int) -> dict[str, Any] | None:
    found: httpx.Response = client.http.get(f"/api/v1/runs/{run_id}/diagnosis")
    body = found.json()
    return body if found.status_code == 200 and body["status"] != "pending" else None
