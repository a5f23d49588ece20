"""A Slurm node that dies mid-run (``testkit/slurm.py`` ``fail_node``: kill -9 its slurmd, its job's
processes frozen as a dead machine's are): Slurm declares NODE_FAIL (SlurmdTimeout 10 s: ~26 s
here) and requeues the job; torchyard makes the job's next run a new attempt that resumes from the
last checkpoint once the node is back, and every (rank, step) is stored once per attempt. Its own
module (and cluster): ~1 minute, apart from ``test_slurm.py``'s two."""

from __future__ import annotations

import pytest

from cli.wait import wait_for
from testkit import slurm
from testkit.stack import metric_rows, row_gaps, run_processes

pytestmark = slurm.module_marks(pytest.mark.chaos)
env = slurm.module_stack("slurm-nodefail")


def test_a_dead_node_is_requeued_by_slurm_and_the_run_resumes_from_its_checkpoint(env: slurm.SlurmStack) -> None:
    steps, every = 1500, 100
    run_id = env.submit("survives-node-fail", nodes=2, procs=1, steps=steps, checkpoint_every=every)
    job = env.job_of(run_id)
    wait_for(lambda: env.client.run(run_id)["last_step"] > every + 20, 60, "a checkpoint to be written")

    env.cluster.fail_node("n2")
    requeued = wait_for(
        lambda: (run := env.client.run(run_id))["attempt_count"] == 2 and run, 60, "Slurm's requeue as attempt 2"
    )
    assert f"Slurm requeued job {job}" in requeued["status_reason"], requeued
    env.cluster.restart_node("n2")
    done = env.client.wait_status(run_id, {"succeeded"}, timeout=60)

    first, second = done["attempts"]
    assert first["status"] == "failed" and second["first_step"] % every == 1 and second["first_step"] > every
    events = env.client.http.get(f"/api/v1/runs/{run_id}/events").json()
    assert [e["to_status"] for e in events].count("restarting") == 1, events
    # row_gaps asserts that no (attempt, rank, key, step) is stored twice; the attempts together have every step
    wait_for(lambda: not row_gaps(metric_rows(env.stack.settings, run_id), steps, 2, {"loss"}), 30, "every step")
    slurm.wait_gone(env.cluster, job)
    wait_for(lambda: not run_processes(run_id, env.stack.settings.checkpoints), 15, "the run's processes to end")
