"""End to end, through real processes: submit over REST, train with torchrun (2 Gloo ranks), and
read back metrics, logs, events and the live stream — on SQLite and on PostgreSQL."""

from __future__ import annotations

import psutil
import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from backend.models import Metric
from cli import sse
from cli.main import main as cli
from cli.wait import wait_for
from testkit.stack import UNTIL_STOPPED, RunningStack, read_sse, run_processes
from torchyard.states import TERMINAL

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]


def test_ddp_run_succeeds_with_every_step_of_every_rank_stored_once(stack: RunningStack) -> None:
    steps = 60
    run = stack.client.submit(name="mlp-ddp", steps=steps, params={"hidden": 64})
    assert run["status"] == "queued"
    done = stack.client.wait_status(run["id"], {"succeeded"})
    assert done["last_step"] == steps

    events = stack.client.http.get(f"/api/v1/runs/{run['id']}/events").json()
    states = [e["to_status"] for e in events if not e["alert"]]  # a live alert is no state change
    assert states == ["queued", "scheduled", "running", "succeeded"]

    # Exactly once: one row per (rank, step) for loss, on both ranks, steps 1..N.
    engine = create_engine(stack.settings.sqlalchemy_url)
    with Session(engine) as session:
        rows = session.execute(
            select(Metric.rank, Metric.step, func.count())
            .where(Metric.run_id == run["id"], Metric.key == "loss")
            .group_by(Metric.rank, Metric.step)
        ).all()
    engine.dispose()
    assert {(rank, step) for rank, step, _ in rows} == {(r, s) for r in (0, 1) for s in range(1, steps + 1)}
    assert all(count == 1 for _, _, count in rows)

    keys = stack.client.http.get(f"/api/v1/runs/{run['id']}/metrics/keys").json()
    assert {"loss", "step_time_s", "samples_per_s", "data_time_s"} <= set(keys)
    series = stack.client.http.get(f"/api/v1/runs/{run['id']}/metrics", params={"key": "loss"}).json()
    assert set(series["ranks"]) == {"0", "1"}
    mean = series["aggregate"]["mean"]
    assert len(mean) == steps
    assert sum(mean[-10:]) / 10 < sum(mean[:10]) / 10, "loss should fall"
    small = stack.client.http.get(f"/api/v1/runs/{run['id']}/metrics", params={"key": "loss", "max_points": 10}).json()
    assert 2 <= len(small["aggregate"]["step"]) <= 10
    assert max(small["aggregate"]["max"]) == max(series["aggregate"]["max"]), "the spike survives downsampling"

    logs = stack.client.http.get(f"/api/v1/runs/{run['id']}/logs").json()
    assert {0, 1} <= {line["rank"] for line in logs}
    assert any(f"step {steps}/{steps}" in line["text"] for line in logs if line["rank"] == 0)
    only_rank1 = stack.client.http.get(f"/api/v1/runs/{run['id']}/logs", params={"rank": 1}).json()
    assert only_rank1 and {line["rank"] for line in only_rank1} == {1}

    nodes = {n["id"]: n for n in stack.client.http.get("/api/v1/nodes").json()}
    ours = nodes[stack.settings.node_id]
    assert ours["slots"] == 4 and ours["free_slots"] == 4 and ours["status"] == "alive" and ours["running_runs"] == []

    listed = stack.client.http.get("/api/v1/runs", params={"status": "succeeded", "name": "mlp-ddp"}).json()
    assert run["id"] in [r["id"] for r in listed["items"]]

    # Rank 0's facts are on its attempt, and the scaling advisor projects the run (the maths:
    # tests/test_advisor.py); at its own world size the projection is the run.
    facts = stack.client.run(run["id"])["attempts"][-1]["facts"]
    assert facts["world"] == 2 and len(facts["calibration"]) == 4 and facts["ops_per_step"]["all_reduce"] >= 1
    answer = stack.client.http.get(f"/api/v1/runs/{run['id']}/projection", params={"ranks": "1-4"})
    assert answer.status_code == 200, answer.text
    projected = answer.json()
    assert [p["ranks"] for p in projected["points"]] == [1, 2, 3, 4] and projected["strategy"] == "ddp"
    assert projected["points"][1]["samples_per_s"] == pytest.approx(projected["measured"]["samples_per_s"])
    refused = stack.client.http.get(f"/api/v1/runs/{run['id']}/projection", params={"ranks": "0"})
    assert refused.status_code == 422 and "between 1 and" in refused.text
    printed = CliRunner().invoke(
        cli, ["project", str(run["id"]), "--ranks", "2,8", "--api-url", stack.url, "--token", stack.token]
    )
    assert printed.exit_code == 0, printed.output
    assert "(measured)" in printed.output and "assumptions:" in printed.output and "weak scaling" in printed.output


def test_stream_delivers_metrics_live_and_resumes_by_last_event_id(stack: RunningStack) -> None:
    steps = 600  # seconds of training on 2 ranks: the first metrics come long before the end
    run = stack.client.submit(name="live", steps=steps, params={"hidden": 32})
    status_at_first_metrics: list[str] = []

    def note(event: sse.Event) -> None:
        if event.event == "metrics" and not status_at_first_metrics:
            status_at_first_metrics.append(stack.client.run(run["id"])["status"])

    first = read_sse(stack, run["id"], limit=25, on_event=note)
    assert status_at_first_metrics and status_at_first_metrics[0] not in TERMINAL, "metrics must arrive while it runs"
    rest = read_sse(stack, run["id"], last_event_id=first[-1].id)
    whole = read_sse(stack, run["id"])  # the run is over: a fresh read replays everything and ends

    resumed_ids = [e.id for e in first + rest]
    assert resumed_ids == [e.id for e in whole], "resuming by Last-Event-ID misses nothing and repeats nothing"
    assert len(set(resumed_ids)) == len(resumed_ids)
    assert whole[-1].event == "state" and whole[-1].data["status"] == "succeeded"
    points = {(e.data["rank"], p[0]) for e in whole if e.event == "metrics" for p in e.data["points"]}
    assert points == {(r, s) for r in (0, 1) for s in range(1, steps + 1)}


@pytest.mark.parametrize("stack", ["sqlite"], indirect=True)  # no database in what it checks
def test_cancel_ends_every_process_of_the_run_on_its_sigterm(stack: RunningStack) -> None:
    """The cancel's SIGTERM ends torchrun and its ranks, and nothing of the run outlives it. The
    grace before SIGKILL is 10 minutes, far beyond this test's waits: a process that ignored the
    SIGTERM (left for the grace's SIGKILL) fails the test, whatever the machine's load."""
    run = stack.client.submit(name="to-cancel", cancel_grace_s=600, **UNTIL_STOPPED)
    wait_for(lambda: stack.client.run(run["id"])["last_step"] > 5, 60, "the run to train a few steps", 0.2)
    procs = run_processes(run["id"], stack.settings.checkpoints)
    assert len(procs) >= 3, f"expected torchrun and 2 ranks, found {procs}"
    cancelled = stack.client.http.post(f"/api/v1/runs/{run['id']}/cancel")
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelling"
    _gone, alive = psutil.wait_procs(procs, timeout=120)
    assert not alive, f"still alive on the cancel's SIGTERM: {alive}"
    stack.client.wait_status(run["id"], {"cancelled"}, timeout=60)
    # and nothing of the run outlives it (torch elastic's helpers included)
    wait_for(
        lambda: not run_processes(run["id"], stack.settings.checkpoints),
        60,
        f"every process of run {run['id']} to end",
        0.1,
    )


@pytest.mark.parametrize("stack", ["sqlite"], indirect=True)  # no database in what it checks
def test_failing_workload_fails_with_its_traceback_and_the_worker_takes_the_next_run(stack: RunningStack) -> None:
    run = stack.client.submit(name="boom", workload="fail", params={"at_step": 3}, steps=10)
    failed = stack.client.wait_status(run["id"], {"failed"})
    assert "RuntimeError: workload 'fail' raised at step 3" in failed["status_reason"]
    events = stack.client.http.get(f"/api/v1/runs/{run['id']}/events").json()
    assert "Traceback" in events[-1]["reason"]
    logs = stack.client.http.get(f"/api/v1/runs/{run['id']}/logs").json()
    assert any("raised at step 3" in line["text"] for line in logs)

    after = stack.client.submit(name="after-failure", steps=5)
    stack.client.wait_status(after["id"], {"succeeded"})
