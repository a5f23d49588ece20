"""A user's own script: upload a bundle, run it as torchrun would (2 Gloo ranks) on a real stack
(SQLite), and get step time and DDP communication for a script that does not change a line."""

from __future__ import annotations

import io
import tarfile
import textwrap
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend import bundles
from cli.wait import wait_for
from testkit.stack import RunningStack, sqlite_stack
from torchyard import archive

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]
LIMIT = 64 * 1024

# Written the way the PyTorch DDP tutorial writes it: nothing torchyard-specific.
TUTORIAL_DDP = """
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 64)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(64, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(steps):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    for step in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


if __name__ == "__main__":
    demo_basic(int(sys.argv[1]))
"""

WITH_SDK = """
import os
import sys

import torchyard
from helpers.values import value_at

for step in range(1, int(sys.argv[1]) + 1):
    torchyard.log(step, my_accuracy=value_at(step), rank_seen=float(os.environ["RANK"]))
print("logged", os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"])
"""

# Rank 1 fails while rank 0 waits for it in a collective (which then fails too, or is ended by torchrun).
RAISES = """
import torch.distributed as dist


def load_shard(rank):
    if rank == 1:
        raise ValueError("bad shard 7")


dist.init_process_group("gloo")
load_shard(dist.get_rank())
dist.barrier()
"""


def zip_bytes(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return buf.getvalue()


def tar_gz_bytes(files: dict[str, str], link: tuple[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = tarfile.SYMTYPE, link[1]
            tf.addfile(info)
    return buf.getvalue()


def upload(client: httpx.Client, data: bytes, filename: str = "code.zip") -> httpx.Response:
    return client.post("/api/v1/bundles", files={"file": (filename, data, "application/octet-stream")})


def script_spec(bundle: str, entry: str, args: list[str], name: str = "script") -> dict[str, Any]:
    return {
        "name": name,
        "workload": {"kind": "script", "bundle": bundle, "entry": entry, "args": args},
        "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu"},
        "training": {"steps": int(args[0]) if args else 100},
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(tmp_path_factory.mktemp("bundles"), max_bundle_bytes=LIMIT) as running:
        yield running


def test_upload_is_checked_before_it_is_stored(stack: RunningStack) -> None:
    http = stack.client.http
    anonymous = httpx.post(f"{stack.url}/api/v1/bundles", files={"file": ("a.zip", zip_bytes({"a.py": ""}))})
    assert anonymous.status_code == 401

    noise = bytes(range(256)) * (LIMIT // 256 + 64)  # just over the limit: read, then refused with why
    too_big = upload(http, zip_bytes({"data.bin": noise.decode("latin-1")}))
    assert too_big.status_code == 413 and "TORCHYARD_MAX_BUNDLE_BYTES" in too_big.json()["detail"]
    assert upload(http, b"x" * (4 * LIMIT)).status_code == 413  # far over: refused from its Content-Length

    not_archive = upload(http, b"print('hello')\n", "train.py")
    assert not_archive.status_code == 422 and "not a zip or tar.gz" in not_archive.text

    for bad, words in [
        (zip_bytes({"../escape.py": "x"}), "'..'"),
        (zip_bytes({"/etc/cron.d/x": "x"}), "absolute path"),
        (tar_gz_bytes({"ok/../../escape.py": "x"}), "'..'"),
        (tar_gz_bytes({"train.py": "x"}, link=("data", "/etc")), "link"),
    ]:
        response = upload(http, bad)
        assert response.status_code == 422, response.text
        assert words in response.text and response.json()["detail"][0]["loc"] == ["body", "file"]
    assert not list(bundles.bundles_dir(stack.settings).glob("*.json")), "nothing refused was stored"

    data = tar_gz_bytes({"pkg/train.py": "print(1)", "pkg/util.py": ""})
    stored = upload(http, data, "code.tar.gz")
    assert stored.status_code == 201, stored.text
    info = stored.json()
    assert info["format"] == "tar.gz" and info["files"] == ["pkg/train.py", "pkg/util.py"]
    assert info["size"] == len(data) and upload(http, data).json()["id"] == info["id"], "content-addressed"
    assert http.get(f"/api/v1/bundles/{info['id']}").json() == info
    assert http.get(f"/api/v1/bundles/{'0' * 64}").status_code == 404

    download = f"{stack.url}/api/v1/bundles/{info['id']}/download"
    assert http.get(download).content == data
    assert httpx.get(download).status_code == 401
    assert httpx.get(download, params={"cap": f"{int(time.time()) + 60}.forged"}).status_code == 403
    capability = bundles.capability(stack.settings, info["id"])  # the api's key, kept in state_dir
    assert httpx.get(download, params={"cap": capability}).content == data
    other = f"{stack.url}/api/v1/bundles/{'1' * 64}/download"
    assert httpx.get(other, params={"cap": capability}).status_code == 403, "a capability is for one bundle"

    missing = http.post("/api/v1/runs", json=script_spec("f" * 64, "train.py", []))
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "workload", "bundle"]
    wrong_entry = http.post("/api/v1/runs", json=script_spec(info["id"], "train.py", []))
    assert wrong_entry.status_code == 422 and "pkg/train.py" in wrong_entry.text
    assert wrong_entry.json()["detail"][0]["loc"] == ["body", "workload", "entry"]


def metric(stack: RunningStack, run_id: int, key: str) -> dict[str, Any]:
    return dict(stack.client.http.get(f"/api/v1/runs/{run_id}/metrics", params={"key": key}).json())


def test_unmodified_tutorial_ddp_script_gets_step_time_and_comm_for_every_step_of_every_rank(
    stack: RunningStack,
) -> None:
    steps = 30
    bundle = upload(stack.client.http, zip_bytes({"train.py": textwrap.dedent(TUTORIAL_DDP)})).json()
    response = stack.client.http.post("/api/v1/runs", json=script_spec(bundle["id"], "train.py", [str(steps)]))
    assert response.status_code == 201, response.text
    run = stack.client.wait_status(response.json()["id"], {"succeeded"})
    assert run["last_step"] == steps

    for key in ("step_time_s", "comm_time_s", "samples_per_s", "exposed_comm_s", "comm_bytes"):
        series = metric(stack, run["id"], key)
        assert set(series["ranks"]) == {"0", "1"}, key
        for rank in ("0", "1"):
            assert series["ranks"][rank]["step"] == list(range(1, steps + 1)), (key, rank)
            values = series["ranks"][rank]["value"]
            assert all(v is not None and (v >= 0 if key == "exposed_comm_s" else v > 0) for v in values), (key, rank)
    # 10×64 + 64 + 64×5 + 5 float32 parameters: one all-reduce of 4,116 bytes per step
    assert set(metric(stack, run["id"], "comm_bytes")["ranks"]["0"]["value"]) == {4116.0}
    samples = metric(stack, run["id"], "samples_per_s")["ranks"]["0"]["value"]
    times = metric(stack, run["id"], "step_time_s")["ranks"]["0"]["value"]
    assert samples[5] == pytest.approx(20 / times[5]), "the batch of 20 is read from the forward's input"
    logs = stack.client.http.get(f"/api/v1/runs/{run['id']}/logs").json()
    assert any("Finished running basic DDP example on rank 1." in line["text"] for line in logs)


def test_script_using_the_sdk_reports_its_own_keys(stack: RunningStack) -> None:
    files = {
        "main.py": WITH_SDK,
        "helpers/__init__.py": "",
        "helpers/values.py": "def value_at(s):\n    return s / 10\n",
    }
    bundle = upload(stack.client.http, tar_gz_bytes(files), "code.tar.gz").json()
    submitted = stack.client.http.post("/api/v1/runs", json=script_spec(bundle["id"], "main.py", ["12"], "sdk"))
    run = stack.client.wait_status(submitted.json()["id"], {"succeeded"})
    keys = stack.client.http.get(f"/api/v1/runs/{run['id']}/metrics/keys").json()
    assert {"my_accuracy", "rank_seen"} <= set(keys)
    series = metric(stack, run["id"], "my_accuracy")
    assert series["ranks"]["1"]["value"] == pytest.approx([s / 10 for s in range(1, 13)])
    assert metric(stack, run["id"], "rank_seen")["ranks"]["1"]["value"][0] == 1.0
    logs = stack.client.http.get(f"/api/v1/runs/{run['id']}/logs").json()
    assert any(line["text"].startswith("logged 2 ") for line in logs), "torchrun's env reaches the script"


def test_a_script_whose_rank_raises_fails_the_run_with_that_ranks_own_exception_first(stack: RunningStack) -> None:
    bundle = upload(stack.client.http, zip_bytes({"shards.py": RAISES})).json()
    submitted = stack.client.http.post("/api/v1/runs", json=script_spec(bundle["id"], "shards.py", [], "boom"))
    failed = stack.client.wait_status(submitted.json()["id"], {"failed"})
    reason = failed["status_reason"]
    print(reason)
    lines = RAISES.splitlines()
    raised, called = (
        lines.index(text) + 1 for text in ('        raise ValueError("bad shard 7")', "load_shard(dist.get_rank())")
    )
    assert reason.startswith(f"ValueError: bad shard 7\non rank 1 at shards.py line {raised}, in load_shard\n"), reason
    assert f'File "shards.py", line {called}, in <module>' in reason, "the last frames, paths as in the bundle"
    assert reason.splitlines()[-1].startswith("torchrun: shards.py FAILED (exit code 1; root cause: rank "), reason
    assert "To enable traceback" not in reason


def test_bundle_tools_refuse_what_a_worker_must_not_unpack(tmp_path: Path) -> None:
    bundle = tmp_path / "x.zip"
    bundle.write_bytes(zip_bytes({"a/b.py": "x", "c.py": "y"}))
    assert archive.extract(bundle, tmp_path / "code", 10_000) == ["a/b.py", "c.py"]
    assert (tmp_path / "code" / "a" / "b.py").read_text() == "x"
    bundle.write_bytes(zip_bytes({"a/../../b.py": "x"}))
    with pytest.raises(archive.BadBundle, match=r"\.\."):
        archive.extract(bundle, tmp_path / "code2", 10_000)
    bundle.write_bytes(zip_bytes({"big.bin": "z" * 5000}))
    with pytest.raises(archive.BadBundle, match="unpacks to"):
        archive.extract(bundle, tmp_path / "code3", 1000)


SCRATCH_AND_CHECKPOINT = """
import os, pathlib, sys, time
pathlib.Path("scratch.bin").write_bytes(b"x" * 1024)  # in the unpacked code's folder (the cwd)
checkpoints = pathlib.Path(os.environ["TORCHYARD_CHECKPOINT_DIR"])
checkpoints.mkdir(parents=True, exist_ok=True)
(checkpoints / f"rank{os.environ['RANK']}.pt").write_bytes(b"weights")
# Every rank's file is there before any rank exits: torchrun ends the other ranks once one exits
# non-zero, and a rank still starting up would never write its own.
while len(list(checkpoints.glob("rank*.pt"))) < int(os.environ["WORLD_SIZE"]):
    time.sleep(0.01)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("exit_code", [0, 3])
def test_a_script_runs_unpacked_code_and_scratch_go_when_it_ends_and_its_checkpoints_stay(
    stack: RunningStack, exit_code: int
) -> None:
    from workers import rundirs

    bundle = upload(stack.client.http, zip_bytes({"train.py": SCRATCH_AND_CHECKPOINT})).json()
    spec = script_spec(bundle["id"], "train.py", [str(exit_code)])
    spec["training"]["steps"] = 1
    response = stack.client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    run_id = response.json()["id"]
    stack.client.wait_status(run_id, {"succeeded" if exit_code == 0 else "failed"})

    run_dir = rundirs.runs_dir(stack.settings) / str(run_id)
    wait_for(lambda: not run_dir.exists(), 10, "the run's directory to be removed")  # gone before the exit report
    assert sorted(p.name for p in (stack.settings.checkpoints / str(run_id)).iterdir()) == ["rank0.pt", "rank1.pt"]
