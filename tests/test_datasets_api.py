"""Datasets as a resource, against a live api (no worker): `torchyard dataset create` writes and
uploads shards, the api checks and indexes each, registers name, samples, bytes, schema and every
shard's sha256; bad input is a 4xx naming what is wrong; a run names a dataset at submit."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.datasets import classification_files, make_dataset, text_files
from testkit.stack import RunningStack, api_only_stack, run_spec
from torchyard import datasets as fmt

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]
MAX_SHARD = 2**20  # the stack's TORCHYARD_MAX_SHARD_BYTES: small, so a 413 is cheap to provoke


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with api_only_stack(tmp_path_factory.mktemp("datasets"), max_shard_bytes=MAX_SHARD) as running:
        yield running


def tar_of(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def put_shard(api: RunningStack, name: str, index: int, body: bytes, **headers: str) -> Any:
    return api.client.http.put(f"/api/v1/datasets/{name}/shards/{index}", content=body, headers=headers)


def detail(response: Any) -> str:
    body = response.json()["detail"]
    return body if isinstance(body, str) else body[0]["msg"]


def test_cli_writes_shards_and_the_registry_holds_what_the_api_measured(api: RunningStack, tmp_path: Path) -> None:
    files = classification_files(tmp_path / "files", 300, input_dim=8)
    cli = [sys.executable, "-m", "cli.main", "dataset"]
    auth = ["--api-url", api.url, "--token", api.token]
    proc = subprocess.run(
        [*cli, "create", "digits", "--from", str(files), "--shard-bytes", str(64 * 1024), *auth],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "300/300 samples" in proc.stderr and "(100%)" in proc.stderr, proc.stderr  # its progress
    assert "dataset digits ready: 300 samples in" in proc.stdout

    got = api.client.http.get("/api/v1/datasets/digits").json()
    assert got["status"] == "ready" and got["samples"] == 300 and got["shards"] == len(got["shard_list"]) >= 2
    assert got["schema"]["cls"] == {"samples": 300, "bytes": sum(len(str(i % 4)) for i in range(300)), "npy": None}
    assert got["schema"]["input.npy"]["npy"] == {"dtype": "<f4", "shape": [8]}
    folder = api.settings.datasets / "digits"
    for shard in got["shard_list"]:  # what the registry says is what is stored
        data = (folder / shard["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"] and len(data) == shard["bytes"]
    assert sum(s["samples"] for s in got["shard_list"]) == 300
    assert sum(s["bytes"] for s in got["shard_list"]) == got["bytes"]
    manifest = fmt.Manifest.read(folder)
    assert (manifest.digest, manifest.samples) == (got["digest"], 300)
    assert oct((folder / fmt.MANIFEST).stat().st_mode & 0o777) == "0o644"  # the ranks read it as another user

    listed = subprocess.run([*cli, "list", *auth], capture_output=True, text=True, timeout=30, check=True)
    assert "digits" in listed.stdout and "300" in listed.stdout and "cls, input.npy" in listed.stdout
    again = subprocess.run([*cli, "create", "digits", "--from", str(files), *auth], capture_output=True, text=True)
    assert again.returncode != 0 and "409: dataset 'digits' exists (ready, 300 samples)" in again.stderr


def test_an_empty_dataset_is_refused(api: RunningStack, tmp_path: Path) -> None:
    assert api.client.http.post("/api/v1/datasets", json={"name": "nothing"}).status_code == 201
    response = api.client.http.post("/api/v1/datasets/nothing/complete")
    assert response.status_code == 422 and "dataset 'nothing' is empty" in detail(response)
    (tmp_path / "empty").mkdir()
    cli = subprocess.run(
        [sys.executable, "-m", "cli.main", "dataset", "create", "hollow", "--from", str(tmp_path / "empty"),
         "--api-url", api.url, "--token", api.token],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert cli.returncode != 0 and "a dataset needs at least one sample" in cli.stderr


def test_bad_shards_are_4xx_naming_what_is_wrong(api: RunningStack) -> None:
    http = api.client.http
    assert http.post("/api/v1/datasets", json={"name": "bad"}).status_code == 201
    assert http.post("/api/v1/datasets", json={"name": "../etc"}).status_code == 422
    assert http.post("/api/v1/datasets", json={"name": "bad"}).status_code == 409

    not_tar = put_shard(api, "bad", 0, b"hello world" * 100)
    assert not_tar.status_code == 422 and "shard 0 of dataset 'bad': not a tar file" in detail(not_tar)
    no_field = put_shard(api, "bad", 0, tar_of({"0001": b"x"}))
    assert no_field.status_code == 422 and "'0001' is not named KEY.FIELD" in detail(no_field)
    body = tar_of({"a.txt": b"one", "b.txt": b"two"})
    damaged = put_shard(api, "bad", 0, body, **{"X-Shard-SHA256": "0" * 64})
    assert damaged.status_code == 422 and "damaged on the way" in detail(damaged)
    too_big = put_shard(api, "bad", 1, b"\0" * (MAX_SHARD + 10))
    assert too_big.status_code == 413 and "TORCHYARD_MAX_SHARD_BYTES" in detail(too_big)

    assert put_shard(api, "bad", 0, body, **{"X-Shard-SHA256": hashlib.sha256(body).hexdigest()}).status_code == 200
    assert put_shard(api, "bad", 2, body).status_code == 200
    gap = http.post("/api/v1/datasets/bad/complete")
    assert gap.status_code == 422 and "is missing shards 1 of 0..2" in detail(gap)
    assert put_shard(api, "bad", 1, tar_of({"c.txt": b"three"})).status_code == 200
    done = http.post("/api/v1/datasets/bad/complete").json()
    assert (done["status"], done["samples"], done["shards"]) == ("ready", 5, 3)
    late = put_shard(api, "bad", 3, body)
    assert late.status_code == 409 and "is ready: its shards cannot change" in detail(late)

    assert http.get("/api/v1/datasets/nope").status_code == 404
    assert http.delete("/api/v1/datasets/bad").status_code == 204
    assert http.get("/api/v1/datasets/bad").status_code == 404
    assert not (api.settings.datasets / "bad").exists()


def test_a_run_names_a_dataset_that_exists_is_ready_and_fits_its_workload(api: RunningStack, tmp_path: Path) -> None:
    make_dataset(api.url, api.token, "vectors", [classification_files(tmp_path / "v", 100, input_dim=8)], 1 << 20)
    make_dataset(api.url, api.token, "prose", [text_files(tmp_path / "t", 20)], 1 << 20)
    http = api.client.http
    assert http.post("/api/v1/datasets", json={"name": "half"}).status_code == 201

    def submit(dataset: str, batch_size: int = 16, **changes: Any) -> Any:
        spec = run_spec(params={"input_dim": 8}, batch_size=batch_size)
        spec.update(data={"dataset": dataset}, **changes)
        return http.post("/api/v1/runs", json=spec)

    unknown = submit("missing")
    assert unknown.status_code == 422
    error = unknown.json()["detail"][0]
    assert error["loc"] == ["body", "data", "dataset"] and error["input"] == "missing"
    assert "data.dataset ('missing') is not a dataset" in error["msg"] and "prose" in error["msg"]
    assert "is still uploading" in detail(submit("half"))
    assert "fewer than training.batch_size (128)" in detail(submit("vectors", batch_size=128))
    wrong_fields = submit("prose")
    assert "reads the field 'input.npy'" in detail(wrong_fields) and "its fields: txt" in detail(wrong_fields)
    wrong_dim = submit("vectors", workload={"kind": "builtin", "name": "mlp", "params": {"input_dim": 9}})
    assert wrong_dim.status_code == 422 and "input_dim (9) does not match dataset 'vectors'" in detail(wrong_dim)

    cli = subprocess.run(
        [sys.executable, "-m", "cli.main", "submit", "--param", "input_dim=7", "--batch-size", "16",
         "--dataset", "vectors", "--api-url", api.url, "--token", api.token],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert cli.returncode != 0 and "422: workload.params.input_dim: workload.params.input_dim (7)" in cli.stderr

    run = submit("vectors")
    assert run.status_code == 201, run.text
    assert run.json()["spec"]["data"] == {
        "dataset": "vectors",
        "shuffle_buffer": 10_000,
        "workers": 2,
        "on_bad_shard": "fail",
    }
    in_use = http.delete("/api/v1/datasets/vectors")  # the run waits (no worker): it still reads the dataset
    assert in_use.status_code == 409 and f"read by run {run.json()['id']} (queued)" in detail(in_use)


def test_the_cli_submits_a_run_that_skips_bad_shards(api: RunningStack, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    make_dataset(api.url, api.token, "skippable", [classification_files(tmp_path / "v", 40, input_dim=8)], 1 << 20)
    auth = ["--api-url", api.url, "--token", api.token]
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("from torchyard import data\n")

    def data_of(*args: str) -> Any:
        result = CliRunner().invoke(main, [*args, *auth])
        assert result.exit_code == 0, result.output
        said = next(line for line in result.output.splitlines() if line.startswith("run "))
        run_id = int(said.split()[1])  # "run 7 queued: ..."
        return api.client.run(run_id)["spec"]["data"]

    builtin = data_of("submit", "--param", "input_dim=8", "--batch-size", "16", "--dataset", "skippable",
                      "--on-bad-shard", "skip")  # fmt: skip
    assert builtin["dataset"] == "skippable" and builtin["on_bad_shard"] == "skip"
    script = data_of("submit-script", str(tmp_path / "code"), "--entry", "train.py", "--dataset", "skippable",
                     "--on-bad-shard", "skip")  # fmt: skip
    assert script["dataset"] == "skippable" and script["on_bad_shard"] == "skip"
    assert (
        data_of("submit", "--param", "input_dim=8", "--batch-size", "16", "--dataset", "skippable")["on_bad_shard"]
        == "fail"
    )
    alone = CliRunner().invoke(main, ["submit", "--on-bad-shard", "skip", *auth])
    assert alone.exit_code == 2 and "--on-bad-shard needs --dataset" in alone.output
    wrong = CliRunner().invoke(main, ["submit", "--dataset", "skippable", "--on-bad-shard", "ignore", *auth])
    assert wrong.exit_code == 2 and "'ignore' is not one of 'fail', 'skip'" in wrong.output
