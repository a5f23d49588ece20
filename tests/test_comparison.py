"""Compare strategies: a run's workload, data, resources and training queued once per strategy
that applies (its own strategy with its options), the others named with the reason; a script run
refused; all or nothing under the caller's quota. The api alone: the runs need only be queued."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from testkit.stack import RunningStack, api_only_stack, run_spec
from torchyard.spec import strategy_kinds

pytestmark = [pytest.mark.stack, pytest.mark.timeout(60)]
IN_FLIGHT = 12  # the token's quota of unfinished runs here


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with api_only_stack(tmp_path_factory.mktemp("compare"), max_runs_in_flight=IN_FLIGHT) as running:
        yield running


def cancel_all(stack: RunningStack) -> None:
    for run in stack.client.http.get("/api/v1/runs", params={"status": "queued"}).json()["items"]:
        stack.client.http.post(f"/api/v1/runs/{run['id']}/cancel")


def test_each_strategy_that_applies_is_queued_with_the_same_workload_and_the_rest_say_why(
    stack: RunningStack,
) -> None:
    spec = run_spec(name="base", procs=2, steps=30, params={"hidden": 16})
    spec["strategy"] = {"kind": "ddp", "comm_hook": "fp16"}
    source = stack.client.http.post("/api/v1/runs", json=spec).json()
    got = stack.client.http.post(f"/api/v1/runs/{source['id']}/strategy-comparison")
    assert got.status_code == 201, got.text
    runs, skipped = got.json()["runs"], {s["strategy"]: s["reason"] for s in got.json()["skipped"]}
    kinds = [r["spec"]["strategy"]["kind"] for r in runs]
    assert sorted(kinds + list(skipped)) == sorted(strategy_kinds()), "every strategy: queued or said why not"
    assert {"ddp", "fsdp", "zero", "local_sgd"} <= set(kinds)
    # 2 ranks: the 2-D mesh needs tp_degree (2) to leave at least two groups
    assert "fsdp_tp" in skipped and "tp_degree" in skipped["fsdp_tp"], skipped
    for run in runs:
        assert run["status"] == "queued"
        assert run["name"] == f"base · {run['spec']['strategy']['kind']}"
        for part in ("workload", "resources", "training", "data"):
            assert run["spec"][part] == source["spec"][part], part
    ddp = next(r for r in runs if r["spec"]["strategy"]["kind"] == "ddp")
    assert ddp["spec"]["strategy"]["comm_hook"] == "fp16", "the run's own strategy keeps its options"
    cancel_all(stack)


def test_a_script_run_is_refused_and_a_quota_too_small_for_all_queues_none(
    stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    script = stack.client.submit_script("own", "own.py", "print('hi')")
    refused = stack.client.http.post(f"/api/v1/runs/{script['id']}/strategy-comparison")
    assert refused.status_code == 422 and "does its own parallelism" in refused.text, refused.text

    # quota: the script and 10 more unfinished runs of this token leave 1 free of 12
    for _ in range(IN_FLIGHT - 2):
        stack.client.submit(name="filler", procs=2)
    source = stack.client.submit(name="source", procs=2)
    before = stack.client.http.get("/api/v1/runs", params={"limit": 500}).json()["total"]
    over = stack.client.http.post(f"/api/v1/runs/{source['id']}/strategy-comparison")
    assert over.status_code == 429 and "unfinished runs" in over.text, over.text
    assert stack.client.http.get("/api/v1/runs", params={"limit": 500}).json()["total"] == before, "none queued"
    cancel_all(stack)

    # the CLI says what it queued, what it did not and where to compare them
    cli = [sys.executable, "-m", "cli.main", "compare-strategies", str(source["id"])]
    cli += ["--api-url", stack.url, "--token", stack.token]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=30, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert "not fsdp_tp: " in out.stdout and f"{stack.url}/#/compare?ids=" in out.stdout, out.stdout
    cancel_all(stack)
