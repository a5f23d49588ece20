"""Datasets in an S3-compatible object store (TORCHYARD_DATASET_STORE=s3://BUCKET/PREFIX), against
a real one on this host (moto's server, ``testkit/objectstore.py``; where it cannot start, skipped
saying why, and a failure under CI: ``testkit/require.py``): the api writes a dataset there, a
2-rank run trains on it reading every sample once per epoch through its presigned URLs, with no
credential of the store; a missing or corrupt object fails naming its shard, or is skipped and
counted, as a bad shard in a folder is."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.datasets import check_read_once, classification_files, make_dataset
from testkit.objectstore import SECRET_KEY, MotoServer, publish
from testkit.require import lacking
from testkit.stack import sqlite_stack
from torchyard import data
from torchyard import datasets as fmt

pytestmark = pytest.mark.timeout(120)
SAMPLES = 203


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    try:
        server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    except RuntimeError as exc:
        lacking(f"no local object store: moto_server (pip install 'moto[server]') did not start: {exc}")
    try:
        yield server
    finally:
        server.stop()


TRAIN = """
import json, os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from torchyard import data

dist.init_process_group("gloo")
rank = dist.get_rank()
folder = Path(os.environ["TORCHYARD_DATASET_DIR"])
seen = json.dumps(dict(os.environ)) + "".join(p.read_text() for p in folder.iterdir())
print(f"rank {rank}: the store's secret {'IS' if SECRET in seen else 'is not'} within reach")


def collate(samples):
    x = torch.from_numpy(np.stack([s["input.npy"] for s in samples]))
    return x, torch.tensor([s["cls"] for s in samples]), [s["__index__"] for s in samples]


model = DDP(torch.nn.Linear(8, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = data.loader(batch_size=5, collate=collate)
for epoch in range(2):
    for step, (x, y, numbers) in enumerate(batches):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # DDP's all-reduce: a rank with a step more would hang here
        optimizer.step()
        print(f"read {epoch} {step} {rank} " + " ".join(map(str, numbers)))
dist.destroy_process_group()
"""


@pytest.mark.stack
def test_a_dataset_created_into_an_object_store_trains_a_two_rank_run_reading_every_sample_once(
    moto: MotoServer, tmp_path: Path
) -> None:
    bucket, client = moto.bucket()
    with sqlite_stack(tmp_path, **moto.settings(bucket)) as stack:
        make_dataset(stack.url, stack.token, "points", [classification_files(tmp_path / "files", SAMPLES)], 24 * 1024)
        registry = stack.client.http.get("/api/v1/datasets/points").json()
        listed = client.list_objects_v2(Bucket=bucket, Prefix="datasets/points/")["Contents"]
        objects = {o["Key"].removeprefix("datasets/points/"): o for o in listed}
        shards = [shard["file"] for shard in registry["shard_list"]]
        assert sorted(objects) == sorted([fmt.MANIFEST, *shards, *map(fmt.index_for, shards)])
        for shard in registry["shard_list"]:  # what the store holds is what the api measured
            body = client.get_object(Bucket=bucket, Key=f"datasets/points/{shard['file']}")["Body"].read()
            assert hashlib.sha256(body).hexdigest() == shard["sha256"]
        assert not (stack.settings.datasets / "points").exists()
        assert not list((stack.settings.datasets / ".uploads").iterdir()), "staged shards are removed once sent"

        bundle = stack.client.upload({"train.py": f"SECRET = {SECRET_KEY!r}\n{TRAIN}"})
        spec = {
            "name": "s3-train",
            "workload": {"kind": "script", "bundle": bundle, "entry": "train.py"},
            "resources": {"procs_per_node": 2},
            "data": {"dataset": "points", "shuffle_buffer": 64, "workers": 1},
        }
        response = stack.client.http.post("/api/v1/runs", json=spec)
        assert response.status_code == 201, response.text
        run_id = response.json()["id"]
        stack.client.wait_status(run_id, {"succeeded"}, timeout=90)
        check_read_once(stack.client, run_id, SAMPLES, batch=5)
        reach = stack.client.log_lines(run_id, "within reach", 2)
        assert all(line.endswith("the store's secret is not within reach") for line in reach), reach

        assert stack.client.http.delete("/api/v1/datasets/points").status_code == 204
        assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="datasets/points/")


def numbers(loader: data.Loader) -> list[int]:
    return [s["__index__"] for batch in loader for s in batch]


@pytest.mark.unit  # a private object store, like the unit tier's private Redis
def test_a_missing_or_corrupt_object_fails_naming_its_shard_or_is_skipped_and_counted(
    moto: MotoServer, tmp_path: Path
) -> None:
    store, client = moto.store(tmp_path / "state")
    folder = tmp_path / "fragile"  # 60 samples, 4 a shard
    fmt.write_dataset(folder, "fragile", [classification_files(tmp_path / "files", 60)], shard_bytes=8 * 1024)
    publish(store, folder, "fragile")
    key = store.key("fragile", fmt.shard_file(1))  # samples 4..7
    view = store.give("fragile", tmp_path / "view", 600).folder
    assert numbers(data.Loader(view, 4, shuffle_buffer=0, workers=1)) == list(range(60))

    raw = bytearray(client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
    raw[1650] ^= 0xFF  # inside sample 0's input.npy: the size stays what the manifest says
    client.put_object(Bucket=store.bucket, Key=key, Body=bytes(raw))
    with pytest.raises(data.ShardError, match=r"shard shard-000001.tar is corrupt: sample 0 field 'input.npy'"):
        numbers(data.Loader(view, 4, shuffle_buffer=0, workers=1))
    skipping = data.Loader(view, 4, shuffle_buffer=0, workers=0, on_bad_shard="skip")
    assert len(numbers(skipping)) == 60 and skipping.bad_samples == 1 and "shard-000001.tar" in skipping.bad

    client.delete_object(Bucket=store.bucket, Key=key)  # gone since the view listed it: a 404 when read
    with pytest.raises(data.ShardError, match=r"shard shard-000001.tar is missing \(http://127.0.0.1:\d+/"):
        numbers(data.Loader(view, 4, shuffle_buffer=0, workers=0))
    view = store.give("fragile", tmp_path / "view-2", 600).folder  # gone when listed: missing at the start
    with pytest.raises(data.ShardError, match=r"shard shard-000001.tar is missing"):
        data.Loader(view, 4, shuffle_buffer=0, workers=0)
    skipping = data.Loader(view, 4, shuffle_buffer=0, workers=0, on_bad_shard="skip")
    assert skipping.left_out == ["shard-000001.tar"] and skipping.samples == 56
    assert sorted(numbers(skipping)) == [n for n in range(60) if not 4 <= n < 8]
    listing = json.loads((view / "objects.json").read_text())
    assert SECRET_KEY not in json.dumps(listing) and all("X-Amz-Signature=" in o["url"] for o in listing.values())
