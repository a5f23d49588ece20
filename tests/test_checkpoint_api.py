"""A run's checkpoints through the api and the CLI: only complete ones are listed; one downloads as a
tar that torch.distributed.checkpoint loads; unknown runs and steps are 404s, path tricks 4xx; and a
cancel of a run with checkpoint_on_cancel leaves a checkpoint at the step the ranks stopped at."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

from cli.wait import wait_for
from testkit.stack import RunningStack, run_processes, run_spec, sqlite_stack
from torchyard import checkpoints as layout
from torchyard.spec import RunSpec
from workers.runtime.workloads import build

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]
PARAMS = {"hidden": 32}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(tmp_path_factory.mktemp("checkpoint-api")) as running:
        yield running


@pytest.fixture(scope="module")
def finished(stack: RunningStack) -> dict[str, Any]:
    """A 30-step run that saved at steps 10, 20 and its last step, 30 (the newest two are kept)."""
    spec = run_spec(name="ckpt", steps=30, params=PARAMS, checkpoint_every=10)
    run_id = int(stack.client.http.post("/api/v1/runs", json=spec).raise_for_status().json()["id"])
    stack.client.wait_status(run_id, {"succeeded"}, timeout=180)
    return {"id": run_id, "spec": spec, "root": stack.settings.checkpoints / str(run_id)}


def listed(stack: RunningStack, run_id: int) -> list[dict[str, Any]]:
    response = stack.client.http.get(f"/api/v1/runs/{run_id}/checkpoints")
    assert response.status_code == 200, response.text
    return list(response.json())


def cli(stack: RunningStack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(
        TORCHYARD_API_URL=stack.url, TORCHYARD_TOKEN=stack.token, TORCHYARD_STATE_DIR=str(stack.settings.state_dir)
    )
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_only_complete_checkpoints_are_listed(stack: RunningStack, finished: dict[str, Any]) -> None:
    root: Path = finished["root"]
    (root / "step-999").mkdir()  # published by hand, never completed
    (root / "step-999" / "__0_0.distcp").write_bytes(b"x" * 100)
    (root / ".step-40.partial").mkdir()  # a save in flight (or one that died half way)
    (root / ".step-40.partial" / layout.COMPLETE).write_text("40")
    (root / "step-notanumber").mkdir()
    (root / "step-500").symlink_to(root / "step-20")  # a link could point anywhere: never served

    items = listed(stack, finished["id"])
    assert [c["step"] for c in items] == [20, 30]  # 10 was removed when 30 was saved
    for c in items:
        on_disk = [p for p in (root / f"step-{c['step']}").rglob("*") if p.is_file()]
        assert c["files"] == len(on_disk) and c["files"] >= 4  # .metadata, a .distcp per rank, rank-N.pt, COMPLETE
        assert c["size_bytes"] == sum(p.stat().st_size for p in on_disk) > 0
        assert c["created_at"]

    shown = cli(stack, "checkpoints", str(finished["id"]))
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["20", "30"], shown.stdout


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_downloads_as_a_tar_that_dcp_loads(
    stack: RunningStack, finished: dict[str, Any], tmp_path: Path
) -> None:
    run_id = finished["id"]
    response = stack.client.http.get(f"/api/v1/runs/{run_id}/checkpoints/20/download")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-tar"
    assert int(response.headers["content-length"]) == len(response.content)
    assert f"run-{run_id}-step-20.tar" in response.headers["content-disposition"]
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path, filter="data")
    assert all(name.startswith("step-20/") for name in names), names
    folder = tmp_path / "step-20"
    assert (folder / layout.COMPLETE).read_text() == "20"
    assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= {p.name for p in folder.iterdir()}
    assert torch.load(folder / "rank-1.pt", weights_only=False)["step"] == 20

    # The weights are real: a fresh model of the same spec loads them (single process, no group).
    model = build(RunSpec.model_validate(finished["spec"])).model
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    model.load_state_dict(state["model"])
    trained = model.state_dict()
    assert trained.keys() == fresh.keys()
    assert all(torch.isfinite(v).all() for v in trained.values())
    assert any(not torch.equal(trained[k], fresh[k]) for k in fresh), "20 steps of training changed nothing"

    # The CLI writes the same bytes, with its progress on stderr.
    out = tmp_path / "ckpt.tar"
    got = cli(stack, "checkpoints", str(run_id), "--download", "20", "-o", str(out))
    assert got.returncode == 0, got.stderr
    assert out.read_bytes() == response.content
    assert f"{len(response.content):,} bytes" in got.stderr
    assert not (tmp_path / "ckpt.tar.part").exists()


def test_unknown_runs_and_steps_are_404s_naming_the_steps_there_are(
    stack: RunningStack, finished: dict[str, Any], tmp_path: Path
) -> None:
    http, run_id = stack.client.http, finished["id"]
    assert http.get("/api/v1/runs/987654/checkpoints").status_code == 404
    assert http.get("/api/v1/runs/987654/checkpoints/10/download").status_code == 404
    for step in (15, 999, 40, 500):  # none, incomplete, hidden staging, a symlink
        missing = http.get(f"/api/v1/runs/{run_id}/checkpoints/{step}/download")
        assert missing.status_code == 404, (step, missing.text)
        assert (
            missing.json()["detail"]
            == f"run {run_id} has no checkpoint at step {step}: its checkpoints are at steps 20, 30"
        )
    bad = cli(stack, "checkpoints", str(run_id), "--download", "15", "-o", str(tmp_path / "x.tar"))
    assert bad.returncode != 0 and "steps 20, 30" in bad.stderr
    assert not list(tmp_path.iterdir())

    # A run without checkpoints lists none.
    spec = run_spec(name="no-ckpt", steps=3, params=PARAMS)
    other = int(http.post("/api/v1/runs", json=spec).raise_for_status().json()["id"])
    assert listed(stack, other) == []
    stack.client.wait_status(other, {"succeeded"}, timeout=120)
    assert listed(stack, other) == []
    assert http.get(f"/api/v1/runs/{other}/checkpoints/0/download").json()["detail"] == (
        f"run {other} has no checkpoint at step 0: it has no complete checkpoint"
    )


@pytest.mark.parametrize(
    "step",
    ["..%2F..%2F..%2Fetc%2Fpasswd", "..%2F10", "step-10", ".step-40.partial", "10%00", "-1", "1e1", "%2Fetc"],
)
def test_path_tricks_in_the_step_are_refused(stack: RunningStack, finished: dict[str, Any], step: str) -> None:
    response = stack.client.http.get(f"/api/v1/runs/{finished['id']}/checkpoints/{step}/download")
    assert 400 <= response.status_code < 500, (step, response.status_code, response.text[:200])
    assert not response.content.startswith(b"step-")  # never a tar


def test_cancel_with_checkpoint_on_cancel_saves_where_the_ranks_stopped(stack: RunningStack) -> None:
    every = 200
    spec = run_spec(name="save-on-cancel", steps=10_000_000, params=PARAMS, checkpoint_every=every)
    spec["training"]["checkpoint_on_cancel"] = True
    http = stack.client.http
    run_id = int(http.post("/api/v1/runs", json=spec).raise_for_status().json()["id"])
    periodic = wait_for(lambda: listed(stack, run_id), 120, "the first periodic checkpoint", 0.2)
    last_periodic = max(c["step"] for c in periodic)

    http.post(f"/api/v1/runs/{run_id}/cancel").raise_for_status()
    stack.client.wait_status(run_id, {"cancelled"}, timeout=180)  # past the 120 s grace: a save beyond it fails below
    _gone, alive = psutil.wait_procs(run_processes(run_id, stack.settings.checkpoints), timeout=15)
    assert not alive, f"left running: {alive}"

    def saved_on_cancel() -> list[int]:
        lines = http.get(f"/api/v1/runs/{run_id}/logs", params={"limit": 5000}).json()
        marked = [line["text"] for line in lines if "cancelled; checkpoint saved at step" in line["text"]]
        return [int(text.split("at step ")[1].split(":")[0]) for text in marked] if len(marked) == 2 else []

    steps = wait_for(saved_on_cancel, 30, "both ranks' 'saved on cancel' lines", 0.2)
    assert steps[0] == steps[1], f"the ranks saved at different steps: {steps}"
    stopped = steps[0]
    assert stopped > last_periodic
    items = listed(stack, run_id)
    assert items[-1]["step"] == stopped, items
    folder = stack.settings.checkpoints / str(run_id) / f"step-{stopped}"
    assert (folder / layout.COMPLETE).read_text() == str(stopped)
    assert all(torch.load(folder / f"rank-{r}.pt", weights_only=False)["step"] == stopped for r in (0, 1))


def test_a_crashed_rank_is_no_cancel_its_peers_exit_without_saving(stack: RunningStack) -> None:
    """torch elastic SIGTERMs the other ranks when one crashes: no cancel, so no save (the launcher
    marks a cancel before its own SIGTERM)."""
    spec = run_spec(name="crash", workload="fail", steps=1000)
    spec["workload"]["params"] = {"at_step": 20, "rank": 1}
    spec["training"]["checkpoint_on_cancel"] = True
    run_id = int(stack.client.http.post("/api/v1/runs", json=spec).raise_for_status().json()["id"])
    failed = stack.client.wait_status(run_id, {"failed"}, timeout=120)
    assert "workload 'fail' raised at step 20" in failed["status_reason"]
    assert listed(stack, run_id) == []
    lines = stack.client.http.get(f"/api/v1/runs/{run_id}/logs", params={"limit": 5000}).json()
    assert not [line for line in lines if "cancelled; checkpoint saved" in line["text"]]


def test_checkpoint_on_cancel_needs_a_strategy_that_checkpoints(stack: RunningStack) -> None:
    spec = run_spec(name="local-sgd", steps=10, params=PARAMS)
    spec["strategy"] = {"kind": "local_sgd"}
    spec["training"]["checkpoint_on_cancel"] = True
    response = stack.client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 422
    assert "checkpoint_on_cancel" in response.text and "local_sgd" in response.text
