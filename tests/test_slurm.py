"""Runs on a Slurm pool: a real Slurm cluster of two nodes on this host (``testkit/slurm.py``:
Debian's slurmctld, two slurmd and munged, started here as root), beside the built-in pool of the
stack's own worker. A 2-node DDP run on Slurm matches the same world on our worker step by step;
cancel (pending, running) ends the Slurm job and every process; a bad pool, partition or node count
is a 422 naming it. The whole file is bounded to ~2 minutes on a loaded 2-core machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli.wait import wait_for
from testkit import browser as chromium
from testkit import slurm
from testkit.stack import UNTIL_STOPPED, run_processes, run_spec

pytestmark = slurm.module_marks()
env = slurm.module_stack("slurm")


def test_two_nodes_on_slurm_match_one_node_on_our_worker_step_by_step(env: slurm.SlurmStack) -> None:
    steps = 20
    ours = env.submit("ours-1x4", nodes=1, procs=4, pool="local", steps=steps)
    on_slurm = env.submit("slurm-2x2", nodes=2, procs=2, steps=steps)
    job = env.job_of(on_slurm)
    for run_id in (on_slurm, ours):
        env.client.wait_status(run_id, {"succeeded"}, timeout=90)

    run = env.client.run(on_slurm)
    assert f"Slurm job {job} succeeded" in run["status_reason"], run
    events = env.client.http.get(f"/api/v1/runs/{on_slurm}/events").json()
    assert any(e["to_status"] == "running" and "slurm-hpc-n" in e["reason"] for e in events), events
    lines = env.client.http.get(f"/api/v1/runs/{on_slurm}/logs", params={"limit": 5000}).json()
    assert {line["rank"] for line in lines} >= {0, 1, 2, 3}, lines[:5]

    one, two = env.mean_loss(ours), env.mean_loss(on_slurm)
    assert len(one) == len(two) == steps
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True))
    assert worst <= 1e-4, f"2 × 2 on Slurm differs from 1 × 4 on our worker by {worst:.2e} (relative) at worst"
    slurm.wait_gone(env.cluster, job)


def test_cancel_while_pending_and_while_running_ends_the_job_and_every_process(env: slurm.SlurmStack) -> None:
    running = env.submit("slurm-running", nodes=2, procs=1, **UNTIL_STOPPED)
    running_job = env.job_of(running)
    env.client.wait_status(running, {"running"}, timeout=60)
    # Each node has 2 CPUs and the running job holds one of each: a run of 2 per node must wait.
    waiting = env.submit("slurm-waiting", nodes=2, procs=2, steps=10)
    waiting_job = env.job_of(waiting)

    def pending() -> dict[str, Any] | None:
        run = env.client.run(waiting)
        return run if "PENDING (Resources)" in run["status_reason"] else None

    run = wait_for(pending, 30, "Slurm's pending reason as the run's status_reason", interval=0.2)
    assert run["status"] == "scheduled" and f"job {waiting_job}" in run["status_reason"], run
    assert env.client.http.post(f"/api/v1/runs/{waiting}/cancel").status_code == 202
    env.client.wait_status(waiting, {"cancelled"}, timeout=30)
    slurm.wait_gone(env.cluster, waiting_job)

    checkpoints = env.stack.settings.checkpoints
    wait_for(lambda: len(run_processes(running, checkpoints)) >= 2, 30, "both nodes' ranks")
    pids = [p.pid for p in run_processes(running, checkpoints)]
    assert env.client.http.post(f"/api/v1/runs/{running}/cancel").status_code == 202
    env.client.wait_status(running, {"cancelled"}, timeout=30)
    slurm.wait_gone(env.cluster, running_job)
    wait_for(lambda: not run_processes(running, checkpoints), 15, f"run {running}'s processes {pids} to end")
    wait_for(lambda: not env.cluster.step_processes(), 15, "every process of the Slurm jobs to end")


@pytest.mark.parametrize(
    ("resources", "field", "named"),
    [
        ({"pool": "nowhere"}, "pool", "'nowhere'"),
        ({"pool": "hpc", "partition": "gpu-huge"}, "partition", "'gpu-huge'"),
        ({"pool": "hpc", "nodes": 4}, "nodes", "partition 'debug'"),
        ({"pool": "local", "partition": "debug"}, "partition", "Slurm pools only"),
    ],
)
def test_a_bad_pool_partition_or_node_count_is_a_422_naming_it(
    env: slurm.SlurmStack, resources: dict[str, Any], field: str, named: str
) -> None:
    spec = run_spec(name="bad")
    spec["resources"].update(resources)
    response = env.client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"][-1] == field and named in detail["msg"], detail


def test_the_cluster_helper_leaves_nothing_behind(tmp_path: Path) -> None:
    with slurm.slurm_cluster(tmp_path / "c") as cluster:
        daemons = [p.pid for p in cluster.procs.values()]
    import psutil

    assert not [pid for pid in daemons if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_a_job_sbatch_refuses_fails_the_run_with_slurms_own_message(env: slurm.SlurmStack) -> None:
    spec = run_spec(name="no-gpus-there", procs=1)
    spec["resources"].update(nodes=1, pool="hpc", device="cuda")  # the cluster's nodes have no GPUs (no GRES)
    response = env.client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    run_id = response.json()["id"]
    run = env.client.wait_status(run_id, {"failed"}, timeout=30)
    assert run["status_reason"].startswith("sbatch refused the job: sbatch: error:"), run
    assert "Invalid generic resource (gres) specification" in run["status_reason"], run


@pytest.mark.browser
def test_the_cluster_page_shows_the_slurm_pool_its_nodes_and_runs(env: slurm.SlurmStack) -> None:
    sync_api = chromium.sync_api()
    run_id = env.submit("slurm-shown", nodes=2, procs=1, **UNTIL_STOPPED)
    job = env.job_of(run_id)
    with sync_api.sync_playwright() as p:
        browser = chromium.launch(p)
        try:
            page = browser.new_context(base_url=env.stack.url).new_page()
            page.goto(f"/#/login?token={env.stack.token}")
            sync_api.expect(page.get_by_test_id("runs-table")).to_be_visible(timeout=30_000)
            page.goto("/#/cluster")
            pool = page.get_by_test_id("pool-hpc")
            sync_api.expect(pool).to_contain_text("Slurm pool hpc", timeout=30_000)
            sync_api.expect(pool).to_contain_text("debug* · 2 nodes")
            nodes = pool.get_by_test_id("slurm-nodes")
            for name in ("n1", "n2"):
                sync_api.expect(nodes).to_contain_text(name)
            sync_api.expect(pool).to_contain_text(f"#{run_id} · job {job}", timeout=15_000)
            chromium.shot(page, "cluster-slurm-pool")
        finally:
            browser.close()
    assert env.client.http.post(f"/api/v1/runs/{run_id}/cancel").status_code == 202
    env.client.wait_status(run_id, {"cancelled"}, timeout=30)
    slurm.wait_gone(env.cluster, job)
