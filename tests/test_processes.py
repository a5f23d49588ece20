"""What real clusters do to processes: `torchyard up` stopped with Ctrl-C, and a worker killed
with -9 whose training processes live on until the restarted worker ends them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import Client, start_stack
from tests.test_e2e import run_processes
from torchyard.procs import RedisServer, free_port, wait_for

pytestmark = pytest.mark.timeout(180)


def test_up_serves_the_cli_and_ctrl_c_stops_every_process_it_started(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_STATE_DIR=str(tmp_path / "state"), TORCHYARD_PORT=str(port), TORCHYARD_NODE_SLOTS="4")
    up = subprocess.Popen(
        [sys.executable, "-m", "torchyard.cli", "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        printed = []
        for line in up.stdout:  # type: ignore[union-attr]
            printed.append(line)
            if line.startswith("admin token:"):
                break
        token = printed[-1].split(":", 1)[1].strip()
        assert any(f"http://127.0.0.1:{port}/" in line and token in line for line in printed), printed
        assert any("sqlite:///" in line for line in printed) and any("redis://127.0.0.1:" in line for line in printed)
        client = Client(f"http://127.0.0.1:{port}", token)
        wait_for(lambda: client.http.get("/api/v1/nodes").json(), 30, "the worker's heartbeat")

        cli = [sys.executable, "-m", "torchyard.cli"]
        submitted = subprocess.run(
            [*cli, "submit", "--steps", "10000000", "--procs", "2", "--name", "forever"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert submitted.returncode == 0, submitted.stderr
        run_id = int(submitted.stdout.split()[1])
        wait_for(lambda: client.run(run_id)["last_step"] > 2, 60, "the run to train")
        listed = subprocess.run([*cli, "runs"], env=env, capture_output=True, text=True, timeout=30)
        assert "forever" in listed.stdout and "running" in listed.stdout
        bad = subprocess.run([*cli, "submit", "--procs", "0"], env=env, capture_output=True, text=True, timeout=30)
        assert bad.returncode != 0 and "procs_per_node" in bad.stderr and "(got 0)" in bad.stderr
        followed = subprocess.run(
            [*cli, "submit", "--steps", "20", "--procs", "2", "--name", "followed", "--follow"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert followed.returncode == 0, followed.stderr  # --follow exits with the run's outcome
        assert "[rank 0] step 20/20" in followed.stdout and "[rank 1]" in followed.stdout, followed.stdout
        assert "--- running" in followed.stderr and "--- succeeded" in followed.stderr, followed.stderr

        children = psutil.Process(up.pid).children(recursive=True) + run_processes(run_id)
        assert len(run_processes(run_id)) >= 3
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left running after Ctrl-C: {alive}"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/healthz")
    finally:
        if up.poll() is None:
            up.kill()


def test_a_killed_worker_leaves_no_orphans_and_its_run_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    stack = start_stack(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", redis)
    steps, every = 2000, 200
    try:
        run = stack.client.submit(name="survivor", steps=steps, params={"hidden": 32}, checkpoint_every=every)
        wait_for(lambda: stack.client.run(run["id"])["last_step"] > 2 * every + 50, 90, "a checkpoint and more steps")
        worker = psutil.Process(stack.stack.procs["worker"].pid)
        celery_tree = [worker, *worker.children(recursive=True)]
        celery_tree = [p for p in celery_tree if p not in run_processes(run["id"])]
        for proc in celery_tree:
            proc.kill()
        psutil.wait_procs(celery_tree, timeout=10)
        orphans = run_processes(run["id"])
        assert len(orphans) >= 3, "the trap: killing the worker leaves the run's processes training"

        stack.stack.spawn("worker")
        _gone, alive = psutil.wait_procs(orphans, timeout=30)
        assert not alive, f"the restarted worker left orphans: {alive}"
        done = stack.client.wait_status(run["id"], {"succeeded"}, timeout=120)
        assert done["attempt_count"] == 2

        events = stack.client.http.get(f"/api/v1/runs/{run['id']}/events").json()
        states = [e["to_status"] for e in events]
        assert states[:3] == ["queued", "scheduled", "running"] and states[-1] == "succeeded"
        restart = next(e for e in events if e["to_status"] == "restarting")
        assert ("restarted" in restart["reason"] or "lost" in restart["reason"]) and "attempt 2 of 3" in restart[
            "reason"
        ]
        logs = stack.client.http.get(f"/api/v1/runs/{run['id']}/logs", params={"limit": 10000}).json()
        resumed = [line["text"] for line in logs if "resumed from the checkpoint at step" in line["text"]]
        resumed_at = {int(t.split("resumed from the checkpoint at step ")[1].split()[0]) for t in resumed}
        assert len(resumed_at) == 1 and resumed_at.pop() in range(2 * every, steps, every), resumed

        # Every step has exactly one value per rank: the replayed steps show the newer attempt's.
        series = stack.client.http.get(f"/api/v1/runs/{run['id']}/metrics", params={"key": "loss"}).json()
        for rank in ("0", "1"):
            assert series["ranks"][rank]["step"] == list(range(1, steps + 1))
    finally:
        stack.stack.stop()
        redis.stop()
