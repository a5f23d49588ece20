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

from cli.redis_server import RedisServer
from cli.wait import wait_for
from testkit.stack import UNTIL_STOPPED, Client, metric_rows, paced, row_gaps, run_processes, start_stack
from torchyard.net import free_port
from workers import rundirs

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]
STEPS = 400  # the run that up saves on its Ctrl-C


def test_up_serves_the_cli_and_ctrl_c_stops_every_process_it_started(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_STATE_DIR=str(tmp_path / "state"), TORCHYARD_PORT=str(port), TORCHYARD_NODE_SLOTS="4")
    up = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # all a user sees in their terminal
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
        assert any("sqlite:///" in line for line in printed) and any(
            "redis://torchyard:***@127.0.0.1:" in line
            for line in printed  # the platform's password is not printed
        )
        client = Client(f"http://127.0.0.1:{port}", token)
        wait_for(lambda: client.http.get("/api/v1/nodes").json(), 30, "the worker's heartbeat")

        cli = [sys.executable, "-m", "cli.main"]
        # stepping until Ctrl-C, paced (testkit/stack.py: UNTIL_STOPPED) so as not to take both cores
        paced = ["--workload", "fail", *(f"--param={k}={v}" for k, v in UNTIL_STOPPED["params"].items())]
        submitted = subprocess.run(
            [*cli, "submit", "--steps", "10000000", "--procs", "2", "--name", "forever", *paced],
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

        ours = run_processes(run_id, tmp_path / "state" / "checkpoints")  # not another stack's run of this id
        children = psutil.Process(up.pid).children(recursive=True) + ours
        assert len(ours) >= 3
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
        said = up.stdout.read()  # type: ignore[union-attr]
        assert f"run {run_id} 'forever' at step" in said and "it starts again from step 1" in said, said
        assert "GET /api/v1" not in "".join(printed) + said, "quiet by default: no access log"
        # ... and no banners: Celery's, uvicorn's start-up lines (the link is what is printed last)
        banners = (
            "celery@",
            "[tasks]",
            "transport:",
            "Uvicorn running",
            "Started server process",
            "Application startup",
        )
        noise = [line for line in [*printed, *said.splitlines()] if any(b in line for b in banners)]
        assert not noise and len(printed) <= 15, "".join(printed)
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left running after Ctrl-C: {alive}"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/healthz")
    finally:
        if up.poll() is None:
            up.kill()


def start_up(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """`torchyard up`, once it printed its admin token (the last line of its start)."""
    up = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    for line in up.stdout:  # type: ignore[union-attr]
        if line.startswith("admin token:"):
            return up, line.split(":", 1)[1].strip()
    raise AssertionError(f"up exited with {up.wait()} before printing its token")


@pytest.mark.timeout(120)
def test_ctrl_c_on_up_saves_a_run_that_saves_on_cancel_and_the_next_up_resumes_it(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_STATE_DIR=str(tmp_path / "state"), TORCHYARD_PORT=str(port), TORCHYARD_NODE_SLOTS="2")
    up, token = start_up(env)
    try:
        client = Client(f"http://127.0.0.1:{port}", token)
        # Paced (12 s at least): still training when up stops, whatever the machine's speed
        run_id = client.submit(
            name="saves-on-stop", **paced(STEPS, 0.03), checkpoint_every=100_000, checkpoint_on_cancel=True
        )["id"]
        wait_for(lambda: client.run(run_id)["last_step"] > 20, 90, "the run to train")
        up.send_signal(signal.SIGINT)
        said = up.communicate(timeout=180)[0]
        assert up.returncode == 0, said
        assert f"run {run_id} 'saves-on-stop' at step" in said and "saves a checkpoint at its next step" in said, said

        up, token = start_up(env)  # the same state dir: the same database, checkpoints and token
        client = Client(f"http://127.0.0.1:{port}", token)
        saved = [c["step"] for c in client.http.get(f"/api/v1/runs/{run_id}/checkpoints").json()]
        assert len(saved) == 1 and 20 < saved[0] < STEPS, saved
        done = client.wait_status(run_id, {"succeeded"}, timeout=150)
        assert done["attempt_count"] == 2
        texts = [
            line["text"] for line in client.http.get(f"/api/v1/runs/{run_id}/logs", params={"limit": 10000}).json()
        ]
        assert any(f"the worker is stopping; checkpoint saved at step {saved[0]}" in t for t in texts), [
            t for t in texts if "checkpoint" in t
        ]
        assert any(f"resumed from the checkpoint at step {saved[0]}" in t for t in texts), texts[-40:]
        events = client.http.get(f"/api/v1/runs/{run_id}/events").json()
        restart = next(e for e in events if e["to_status"] == "restarting")
        assert "shut down while the run was training" in restart["reason"], restart
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
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
        celery_tree = [p for p in celery_tree if p not in run_processes(run["id"], stack.settings.checkpoints)]
        for proc in celery_tree:
            proc.kill()
        psutil.wait_procs(celery_tree, timeout=10)
        orphans = run_processes(run["id"], stack.settings.checkpoints)
        assert len(orphans) >= 3, "the trap: killing the worker leaves the run's processes training"
        run_dir = rundirs.runs_dir(stack.settings) / str(run["id"])
        assert (run_dir / "attempt-1").is_dir(), "the killed worker never removed its share's run directory"

        stack.stack.spawn("worker")
        _gone, alive = psutil.wait_procs(orphans, timeout=30)
        assert not alive, f"the restarted worker left orphans: {alive}"
        wait_for(
            lambda: not (run_dir / "attempt-1").exists(), 30, "the restarted worker to remove the dead share's dir"
        )
        done = stack.client.wait_status(run["id"], {"succeeded"}, timeout=120)
        assert done["attempt_count"] == 2
        assert not run_dir.exists(), "the run ended: its scratch is gone"
        assert any((stack.settings.checkpoints / str(run["id"])).iterdir()), "its checkpoints are kept"

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
        # the orphans train on until the new worker ends them: on a fast machine to the last step,
        # whose checkpoint (training.checkpoint_final) the next attempt then starts from
        assert len(resumed_at) == 1 and (resumed_step := resumed_at.pop()) in range(2 * every, steps + 1, every), (
            resumed
        )

        # Every step has one value per rank in the api (the replayed steps show the newer attempt's),
        # and in the database each attempt stored each of its steps once, the two together every step.
        series = stack.client.http.get(f"/api/v1/runs/{run['id']}/metrics", params={"key": "loss"}).json()
        for rank in ("0", "1"):
            assert series["ranks"][rank]["step"] == list(range(1, steps + 1))
        rows = wait_for(
            lambda: (
                (got := metric_rows(stack.settings, run["id"]))
                and not row_gaps(got, steps, ranks=2, keys={"loss", "step_time_s"})
                and got
            ),
            15,
            "every stored step of both attempts",
        )
        # attempt 2 stored the steps after its checkpoint: none when the orphans reached the last one
        assert {attempt for attempt, *_ in rows} == ({1, 2} if resumed_step < steps else {1}), resumed_step
    finally:
        stack.stack.stop()
        redis.stop()
