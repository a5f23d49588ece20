"""Runs that read a registered dataset, on a real stack (its worker as root: ranks as the run user in
their own namespaces): the mlp trains on one by name; a script reads one with
``torchyard.data.loader``, every sample once per epoch across its ranks and loader processes, and
cannot write to it; a corrupt or missing shard fails the run naming the shard, or with
``on_bad_shard: skip`` is skipped and counted; every rank reports its input figures."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli.wait import wait_for
from testkit.datasets import check_read_once, classification_files, make_dataset
from testkit.stack import RunningStack, run_processes, run_spec, sqlite_stack
from torchyard import datasets as fmt
from torchyard.checkpoints import complete

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]
SAMPLES = 203  # uneven shards: the last one short
STEP_FIGURES = ("data_time_s", "data_wait_s", "data_copy_s", "step_time_s", "samples_per_s")
READ_FIGURES = ("read_bytes_per_s", "read_samples_per_s")

READER = """
import errno
import os

import torch
import torch.distributed as dist

from torchyard import data

dist.init_process_group("gloo")
rank = dist.get_rank()
batches = data.loader(batch_size=5)
try:
    open(os.path.join(os.environ["TORCHYARD_DATASET_DIR"], "planted"), "w")
    print("wrote into the dataset")
except OSError as exc:
    print(f"rank {rank}: writing into the dataset: {errno.errorcode[exc.errno]}")
for epoch in range(2):
    for step, batch in enumerate(batches):
        ones = torch.ones(1)
        dist.all_reduce(ones)  # a collective every step: a rank with a step more would hang here
        print(f"read {epoch} {step} {rank} " + " ".join(str(s["__index__"]) for s in batch))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    tmp = tmp_path_factory.mktemp("data-runs")
    with sqlite_stack(tmp) as running:
        make_dataset(running.url, running.token, "points", [classification_files(tmp / "files", SAMPLES)], 24 * 1024)
        yield running


def submit(stack: RunningStack, spec: dict[str, Any]) -> int:
    response = stack.client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def mlp_spec(name: str, procs: int = 2, **training: Any) -> dict[str, Any]:
    params = {"input_dim": 8, "classes": 4, "hidden": 16}
    spec = run_spec(name=name, params=params, procs=procs, batch_size=20, **training)
    spec["data"] = {"dataset": "points", "shuffle_buffer": 50, "workers": 1}
    return spec


def metric(stack: RunningStack, run_id: int, key: str, steps: int) -> dict[int, list[float]]:
    """rank -> the run's values of ``key``, step by step, once every rank's ``steps`` are in."""
    found: dict[int, list[float]] = {}

    def complete() -> bool:
        series = stack.client.http.get(f"/api/v1/runs/{run_id}/metrics", params={"key": key}).json()
        found.clear()
        found.update({int(rank): [float(v) for v in s["value"]] for rank, s in series.get("ranks", {}).items()})
        return len(found) == 2 and all(len(values) == steps for values in found.values())

    wait_for(complete, 30, f"{key} of run {run_id} at {steps} steps on 2 ranks", interval=0.5)
    return found


def test_the_mlp_trains_on_a_dataset_it_names_and_each_rank_reports_its_input(stack: RunningStack) -> None:
    """Where a step's data time goes (waiting for the loader vs. the copy to the device: the two add
    up to data_time_s) and what each rank reads from the shards, per second of its steps."""
    steps = 25
    run_id = submit(stack, mlp_spec("data-mlp", steps=steps))  # 10 steps an epoch: 2.5 epochs
    stack.client.wait_status(run_id, {"succeeded"}, timeout=120)
    said = stack.client.log_lines(run_id, "dataset 'points'", 2)
    assert all(f"dataset 'points' ({SAMPLES} samples), epoch 0 at 0" in line for line in said), said
    figures = {key: metric(stack, run_id, key, steps) for key in (*STEP_FIGURES, *READ_FIGURES)}
    schema = stack.client.http.get("/api/v1/datasets/points").json()["schema"]
    per_sample = sum(field["bytes"] for field in schema.values()) / SAMPLES  # input.npy and cls: ~161 bytes
    for rank in (0, 1):
        f = {key: figures[key][rank] for key in figures}
        for step in range(steps):
            wait, copy, total = f["data_wait_s"][step], f["data_copy_s"][step], f["data_time_s"][step]
            assert wait >= 0 and copy >= 0 and wait + copy == pytest.approx(total, abs=1e-9)
            assert total < f["step_time_s"][step]
            assert f["read_samples_per_s"][step] == pytest.approx(f["samples_per_s"][step]), "10 samples a step"
            assert f["read_bytes_per_s"][step] == pytest.approx(per_sample * f["read_samples_per_s"][step], rel=0.02)
        print(
            f"rank {rank}: data wait {np.median(f['data_wait_s']) * 1e3:.2f} ms, copy "
            f"{np.median(f['data_copy_s']) * 1e6:.1f} µs (median), read {np.median(f['read_bytes_per_s']) / 1e3:.1f} KB/s, "
            f"{np.median(f['read_samples_per_s']):.0f} samples/s, step {np.median(f['step_time_s']) * 1e3:.1f} ms"
        )


def test_a_script_reads_every_sample_once_per_epoch_and_cannot_write_the_dataset(stack: RunningStack) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("read.py", READER)
    bundle = stack.client.http.post("/api/v1/bundles", files={"file": ("code.zip", buf.getvalue())}).json()["id"]
    spec = {
        "name": "data-script",
        "workload": {"kind": "script", "bundle": bundle, "entry": "read.py"},
        "resources": {"procs_per_node": 2},
        "data": {"dataset": "points", "shuffle_buffer": 64, "workers": 2},
    }
    run_id = submit(stack, spec)
    stack.client.wait_status(run_id, {"succeeded"}, timeout=120)
    check_read_once(stack.client, run_id, SAMPLES, batch=5)
    refused = stack.client.log_lines(run_id, "writing into the dataset", 2)
    assert all(line.endswith("EROFS") for line in refused), refused  # a read-only bind, not just file modes
    assert not (stack.settings.datasets / "points" / "planted").exists()


def damaged(stack: RunningStack, tmp_path: Path, name: str, damage: str) -> Path:
    """A dataset of 60 samples (4 a shard) whose shard 1 (samples 4..7) is ``damage``d; returns that shard."""
    make_dataset(stack.url, stack.token, name, [classification_files(tmp_path, 60)], 8 * 1024)
    shard = stack.settings.datasets / name / fmt.shard_file(1)
    if damage == "gone":  # the whole folder: a worker whose TORCHYARD_DATASET_ROOT is not the api's
        shutil.rmtree(shard.parent)
    elif damage == "missing":
        shard.unlink()
    else:
        raw = bytearray(shard.read_bytes())
        raw[1650] ^= 0xFF  # inside sample 0's input.npy (its 2nd member): the size stays what the manifest says
        shard.write_bytes(bytes(raw))
    return shard


@pytest.mark.parametrize("damage", ["corrupt", "missing", "gone"])
def test_a_bad_shard_fails_the_run_naming_it(stack: RunningStack, tmp_path: Path, damage: str) -> None:
    name = f"fragile-{damage}"
    shard = damaged(stack, tmp_path, name, damage)
    # one rank: the first to meet the shard fails the run, which the other ranks would only follow
    spec = mlp_spec(f"data-{damage}", procs=1, steps=10, max_attempts=1)
    spec["data"] = {"dataset": name, "shuffle_buffer": 0, "workers": 1}
    run_id = submit(stack, spec)
    reason = stack.client.wait_status(run_id, {"failed"}, timeout=120)["status_reason"]
    if damage == "gone":
        assert reason.startswith("the worker could not launch the run"), reason
        assert f"FileNotFoundError: dataset '{name}' is not at {shard.parent} on node" in reason, reason
        return
    expected = "is missing" if damage == "missing" else "is corrupt: sample 0 field 'input.npy'"
    assert reason.startswith(f"ShardError: dataset '{name}': shard shard-000001.tar {expected}"), reason


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_with_on_bad_shard_skip_the_run_succeeds_and_counts_the_shard(
    stack: RunningStack, tmp_path: Path, damage: str
) -> None:
    """Missing at the start: both ranks leave shard 1 out (56 samples, 2 steps an epoch). Corrupt:
    global sample 4 fails its CRC-32; in the stored order it is position 4 of every epoch, so rank 0
    (even positions) meets it in steps 1, 4, 7 and 10 and rank 1 never."""
    name = f"skipped-{damage}"
    damaged(stack, tmp_path, name, damage)
    steps = 10
    spec = mlp_spec(f"data-skip-{damage}", steps=steps, max_attempts=1)
    spec["data"] = {"dataset": name, "shuffle_buffer": 0, "workers": 1, "on_bad_shard": "skip"}
    run_id = submit(stack, spec)
    stack.client.wait_status(run_id, {"succeeded"}, timeout=120)
    shards, samples = metric(stack, run_id, "bad_shards", steps), metric(stack, run_id, "bad_samples", steps)
    told = stack.client.log_lines(run_id, "skipping bad shard shard-000001.tar", 2 if damage == "missing" else 1)
    if damage == "missing":
        assert shards == {0: [1.0] * steps, 1: [1.0] * steps} and samples == {0: [0.0] * steps, 1: [0.0] * steps}
        assert "is missing" in told[0] and len(told) == 2
        assert all(
            f"dataset {name!r} (56 samples)" in line for line in stack.client.log_lines(run_id, "(56 samples)", 2)
        )
    else:
        assert shards == {0: [1.0] * steps, 1: [0.0] * steps}
        assert samples[0] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4] and samples[1] == [0.0] * steps
        assert "is corrupt: sample 0 field 'input.npy'" in told[0] and len(told) == 1


def test_a_rank_killed_mid_epoch_comes_back_at_the_checkpoints_data_position(stack: RunningStack) -> None:
    """kill -9 one rank; torch elastic restarts the ranks, which resume from the last checkpoint:
    its data position (saved under the ranks' wall, read back) is mid-epoch, where its step says.
    (Which samples each step reads after such a resume: tests/test_data_dist.py.)"""
    spec = mlp_spec("data-resume", steps=40, checkpoint_every=7, max_restarts=1)
    spec["workload"]["params"]["hidden"] = 2048  # ~0.1 s a step: time to kill it mid-run
    run_id = submit(stack, spec)
    wait_for(lambda: stack.client.run(run_id)["last_step"] >= 16, 120, f"run {run_id} past step 16", interval=0.2)
    ranks = [p for p in run_processes(run_id, stack.settings.checkpoints) if p.environ().get("RANK") == "1"]
    victim = next(p for p in ranks if p.parent() not in ranks)  # the rank, not one of its loader processes
    victim.kill()
    stack.client.wait_status(run_id, {"succeeded"}, timeout=150)
    resumed = [line for line in stack.client.log_lines(run_id, "resumed from the checkpoint at step", 2)]
    step = int(resumed[0].split("resumed from the checkpoint at step ")[1].split()[0])
    assert step >= 14 and step % 7 == 0, resumed
    epoch, steps = divmod(step, 10)  # 10 steps an epoch (203 samples, 20 a step)
    assert steps, f"step {step} is at an epoch's end: not the mid-epoch case"
    where = stack.client.log_lines(run_id, f"epoch {epoch} at {steps * 20}", 2)
    assert all(f"dataset 'points' ({SAMPLES} samples), epoch {epoch} at {steps * 20}," in line for line in where)
    saved = {
        s: json.loads((path / "data.json").read_text())
        for s, path in complete(stack.settings.checkpoints / str(run_id))
    }
    # after step s: epoch (s - 1) // 10, with ((s - 1) % 10 + 1) steps of 20 taken (an epoch's last step ends at 200)
    assert all((p["epoch"], p["cursor"]) == ((s - 1) // 10, ((s - 1) % 10 + 1) * 20) for s, p in saved.items()), saved
