"""The chaos suite: what real clusters do to a run, each as one scenario on a live stack (api,
ingest, worker and a private Redis as real processes), each ending in checks that can fail.

- ``kill_worker``: kill -9 the worker and every rank mid-run; a new worker takes the node back,
  the run resumes from its checkpoint and succeeds, every metric of every rank has each step once.
- ``cancel_in_rendezvous`` / ``cancel_in_checkpoint_save`` / ``cancel_mid_step``: a cancel at
  that moment leaves no process of the run (checked by pid, and by scanning for the run's id).
- ``redis_restart``: Redis stopped and started mid-run; the run goes on, 0 points lost.
- ``ingest_restart``: ingest kill -9'd and restarted mid-run; 0 points lost or doubled.
- ``api_restart``: the api kill -9'd and restarted while a stream client reads; the client
  resumes by Last-Event-ID and has every point exactly once.

Two 2-node runs on 3 nodes (gangs, never a partial allocation) need network namespaces: that
scenario is ``tests/test_multinode.py``'s; ``python -m benchmarks.chaos`` repeats it too.

``tests/test_chaos.py`` runs each once in CI; ``python -m benchmarks.chaos --repeat N`` prints pass
counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from cli import sse
from cli.wait import wait_for
from testkit.stack import RunningStack, metric_rows, row_gaps, run_processes, run_spec
from torchyard.states import TERMINAL

# seconds every process of a cancelled run has to be gone in (the launcher's grace is 3 s)
CANCEL_DEADLINE_S = 15


class Chaos:
    """A stack to do damage to: its Redis can be restarted, its processes killed and respawned."""

    def __init__(self, stack: RunningStack) -> None:
        assert stack.redis is not None, "chaos restarts the stack's own Redis"
        self.stack, self.redis, self.client = stack, stack.redis, stack.client

    def submit(self, name: str, steps: int, **training: Any) -> int:
        params = training.pop("params", {"hidden": 32})
        response = self.client.http.post(
            "/api/v1/runs", json=run_spec(name=name, steps=steps, params=params, **training)
        )
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    def wait_step(self, run_id: int, step: int, timeout: float = 120) -> None:
        def reached() -> bool:
            run = self.client.run(run_id)
            assert run["status"] not in TERMINAL, f"run {run_id} ended {run['status']}: {run['status_reason']}"
            return bool(run["last_step"] >= step)

        wait_for(reached, timeout, f"run {run_id} to reach step {step}", interval=0.1)

    def kill(self, name: str) -> None:
        """kill -9 one of the stack's processes (and, for the worker, its Celery children)."""
        proc = psutil.Process(self.stack.stack.procs[name].pid)
        tree = [proc, *proc.children(recursive=True)]
        for p in tree:
            p.kill()
        psutil.wait_procs(tree, timeout=10)
        self.stack.stack.procs[name].wait(10)

    def cancel(self, run_id: int) -> list[psutil.Process]:
        """Cancels the run; returns the run's processes as they were at that moment."""
        procs = run_processes(run_id, self.stack.settings.checkpoints)
        response = self.client.http.post(f"/api/v1/runs/{run_id}/cancel")
        assert response.status_code in (200, 202), response.text  # cancelled at once, or cancelling
        return procs

    def assert_every_point_once(self, run_id: int, steps: int, ranks: int = 2, within_s: float = 15.0) -> None:
        """Every metric key of every rank has steps 1..N, each stored once per attempt (counted in the
        database's rows), within
        ``within_s``: a batch a killed ingest held is taken over once its liveness key expires
        (5 s, and a scan every 2 s), well before the 30 s after which any held entry is taken."""
        gaps: list[str] = []

        def complete() -> bool:
            keys = self.client.http.get(f"/api/v1/runs/{run_id}/metrics/keys").json()
            per_step = {k for k in keys if k != "tokens_per_s"}
            assert {"loss", "step_time_s", "comm_time_s", "exposed_comm_s"} <= per_step, keys
            gaps[:] = row_gaps(metric_rows(self.stack.settings, run_id), steps, ranks, per_step)
            return not gaps

        try:
            wait_for(complete, within_s, f"every point of run {run_id}", interval=0.5)
        except TimeoutError:
            raise AssertionError("; ".join(gaps[:5])) from None

    def assert_ended_after(self, run_id: int, moment: datetime) -> None:
        """The damage was done mid-run: the run ended after it (else the scenario proved nothing)."""
        ended = datetime.fromisoformat(self.client.run(run_id)["ended_at"])
        ended = ended if ended.tzinfo else ended.replace(tzinfo=UTC)
        assert ended > moment, f"run {run_id} ended at {ended}, before the damage at {moment}: make it longer"

    def assert_gone(self, run_id: int, procs: list[psutil.Process]) -> None:
        """No process of the run is left: the ones seen at cancel by pid, and any started since."""
        _gone, alive = psutil.wait_procs(procs, timeout=CANCEL_DEADLINE_S)
        assert not alive, f"alive {CANCEL_DEADLINE_S} s after cancel: {alive}"
        wait_for(
            lambda: not run_processes(run_id, self.stack.settings.checkpoints),
            5,
            f"every process of run {run_id} to end",
        )
        self.client.wait_status(run_id, {"cancelled"}, timeout=30)


# ---- scenarios ----------------------------------------------------------------------------------


def kill_worker(chaos: Chaos) -> None:
    # long enough that the ranks are still running when the stored steps (which trail them by
    # ingest's lag, seconds under load) pass the first checkpoint
    steps, every = 800, 100
    run_id = chaos.submit("chaos-kill-worker", steps, checkpoint_every=every)
    chaos.wait_step(run_id, every + 30)
    ranks = run_processes(run_id, chaos.stack.settings.checkpoints)
    assert len(ranks) >= 3, (ranks, chaos.client.run(run_id)["last_step"])
    chaos.kill("worker")  # the Celery worker and its children
    for proc in ranks:  # and the run's torchrun and ranks: the whole machine's share is gone
        if proc.is_running():
            proc.kill()
    psutil.wait_procs(ranks, timeout=10)
    chaos.stack.stack.spawn("worker")
    done = chaos.client.wait_status(run_id, {"succeeded"}, timeout=180)
    assert done["attempt_count"] >= 2, done
    chaos.assert_every_point_once(run_id, steps)


def cancel_in_rendezvous(chaos: Chaos) -> None:
    run_id = chaos.submit("chaos-cancel-rendezvous", 100_000)
    # torchrun is up, its ranks are still importing torch / meeting in the rendezvous: no step yet
    procs = wait_for(
        lambda: run_processes(run_id, chaos.stack.settings.checkpoints) or None,
        60,
        f"run {run_id}'s torchrun",
        interval=0.02,
    )
    procs = chaos.cancel(run_id) or procs
    chaos.assert_gone(run_id, procs)
    run = chaos.client.run(run_id)
    assert run["last_step"] == 0, f"the cancel came after step {run['last_step']}, not during the rendezvous"


def cancel_in_checkpoint_save(chaos: Chaos) -> None:
    # ~67 MB of weights: each save takes long enough to be caught in the middle
    run_id = chaos.submit(
        "chaos-cancel-save", 100_000, checkpoint_every=3, params={"hidden": 2048, "layers": 4, "input_dim": 256}
    )
    root = chaos.stack.settings.checkpoints / str(run_id)

    def saving() -> list[Path] | None:
        return [p for p in root.glob(".step-*.partial")] or None

    wait_for(saving, 120, f"run {run_id} to be in the middle of a checkpoint save", interval=0.005)
    procs = chaos.cancel(run_id)
    chaos.assert_gone(run_id, procs)
    # the interrupted save is never published; what is published is complete, and listed
    published = list(root.glob("step-*"))
    assert all((p / "COMPLETE").exists() for p in published), published
    listed = {c["step"] for c in chaos.client.http.get(f"/api/v1/runs/{run_id}/checkpoints").json()}
    assert listed == {int(p.name.split("-")[1]) for p in published}, (listed, published)


def cancel_mid_step(chaos: Chaos) -> None:
    run_id = chaos.submit("chaos-cancel-step", 100_000)
    chaos.wait_step(run_id, 5)
    procs = chaos.cancel(run_id)
    assert len(procs) >= 3, procs
    chaos.assert_gone(run_id, procs)


def _survives(chaos: Chaos, name: str, damage: Callable[[], None]) -> None:
    """``damage`` done 50 steps into a 600-step run: it still succeeds after it, every point once."""
    steps = 600
    run_id = chaos.submit(f"chaos-{name}", steps)
    chaos.wait_step(run_id, 50)
    damage()
    back = datetime.now(UTC)
    chaos.client.wait_status(run_id, {"succeeded"}, timeout=180)
    chaos.assert_ended_after(run_id, back)
    chaos.assert_every_point_once(run_id, steps)


def redis_restart(chaos: Chaos) -> None:
    def restart() -> None:
        chaos.redis.stop()  # SIGTERM: redis writes its append-only file and exits
        chaos.redis.start()

    _survives(chaos, "redis-restart", restart)


def ingest_restart(chaos: Chaos) -> None:
    def restart() -> None:
        chaos.kill("ingest")
        chaos.stack.stack.spawn("ingest")

    _survives(chaos, "ingest-restart", restart)


def api_restart(chaos: Chaos) -> None:
    steps = 800
    run_id = chaos.submit("chaos-api-restart", steps)
    url = f"{chaos.stack.url}/api/v1/runs/{run_id}/stream"
    events: list[sse.Event] = []
    restarted = False
    killed_at: datetime | None = None
    reconnects = 0
    deadline = time.monotonic() + 180
    while not (events and events[-1].event == "state" and events[-1].data["status"] in TERMINAL):
        assert time.monotonic() < deadline, "the stream did not reach the run's end"
        headers = {"Authorization": f"Bearer {chaos.stack.token}"}
        if events:
            headers["Last-Event-ID"] = events[-1].id
        try:
            with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(10, read=30)) as response:
                if response.status_code >= 500:  # the api is starting again
                    raise httpx.RemoteProtocolError(f"{response.status_code} while starting")
                assert response.status_code == 200, response.read()
                for event in sse.parse(response.iter_lines()):
                    events.append(event)
                    if not restarted and event.event == "metrics" and event.data["points"][-1][0] > 50:
                        restarted = True
                        chaos.kill("api")  # mid-stream: the connection drops under the client
                        chaos.stack.stack.spawn("api")
                        killed_at = datetime.now(UTC)
        except (httpx.TransportError, httpx.RemoteProtocolError):
            reconnects += 1
            time.sleep(0.2)  # the api is starting again
    assert restarted and reconnects >= 1, (restarted, reconnects)
    assert killed_at is not None
    chaos.assert_ended_after(run_id, killed_at)
    assert events[-1].data["status"] == "succeeded", events[-1].data
    ids = [e.id for e in events]
    assert len(set(ids)) == len(ids), "an event came twice"
    points = [(e.data["rank"], p[0]) for e in events if e.event == "metrics" for p in e.data["points"]]
    assert sorted(points) == sorted((r, s) for r in (0, 1) for s in range(1, steps + 1)), "points lost or doubled"


SCENARIOS: dict[str, Callable[[Chaos], None]] = {
    f.__name__: f
    for f in (
        kill_worker,
        cancel_in_rendezvous,
        cancel_in_checkpoint_save,
        cancel_mid_step,
        redis_restart,
        ingest_restart,
        api_restart,
    )
}
