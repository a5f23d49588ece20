"""What a member's token can submit that used to be taken and then fail later, fail badly, or grow without a bound:
a sweep whose space (or base) asks for a priority the member may not set is a 422 at submit
(it used to be accepted, then its controller failed every pass forever); a dataset shard whose
members are named absolute or with ``..`` is refused like a bundle's; datasets past a member's count
or bytes are refused (429, 413); and a database held by
another writer answers 503 with Retry-After (nothing changed), never a 500."""

from __future__ import annotations

import io
import os
import sqlite3
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from backend.app import create_app
from backend.db import get_engine, get_sessionmaker, transaction
from backend.errors import InvalidRequest
from backend.migrate import upgrade
from backend.models import Run, Token
from backend.security import create_token
from backend.sweep_spec import SweepSpec, check_space
from cli.redis_server import RedisServer
from testkit.stack import run_spec, sweep_spec
from torchyard import datasets
from torchyard.settings import get_settings

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
MEMBER, ADMIN = Token(name="member", role="member"), Token(name="admin", role="admin")


def priority_sweep(**base_resources: Any) -> SweepSpec:
    spec = sweep_spec()
    spec["space"]["resources.priority"] = {"type": "int", "low": 0, "high": 50}
    spec["base"]["resources"].update(base_resources)
    return SweepSpec.model_validate(spec)


def test_a_members_sweep_over_priority_is_refused_at_submit_naming_the_parameter() -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_space(priority_sweep(), MEMBER, max_member_priority=0)
    assert refused.value.loc == ["body", "space", "resources.priority"]
    assert "space['resources.priority']: resources.priority (50) is above 0" in refused.value.msg
    check_space(priority_sweep(), ADMIN, max_member_priority=0)  # an admin may


def test_a_members_sweep_with_a_high_base_priority_is_refused() -> None:
    spec = sweep_spec()
    spec["base"]["resources"]["priority"] = 5
    with pytest.raises(InvalidRequest) as refused:
        check_space(SweepSpec.model_validate(spec), MEMBER, max_member_priority=0)
    assert refused.value.loc == ["body", "base", "resources", "priority"]


@pytest.mark.parametrize("member", ["../../x.txt", "/tmp/x.txt", "a/../../x.txt"])
def test_a_shard_member_named_out_of_its_place_is_refused(tmp_path: Path, member: str) -> None:
    shard = tmp_path / "shard-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for name in ("0001.txt", member):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(datasets.BadShard, match=r"absolute path|climbs out"):
        datasets.index_shard(shard, tmp_path / "shard.idx", datasets.sha256_file(shard))


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, Path]]:
    """The app in-process on a SQLite file of its own that gives up waiting for a lock after 0.2 s,
    a member's token, per-member dataset bounds of 2 datasets and 1 MiB, and 1 MiB of checkpoints."""
    database = tmp_path / "db.sqlite"
    redis = RedisServer(tmp_path / "redis").start()
    for name, value in {
        "STATE_DIR": str(tmp_path / "state"),
        "DATABASE_URL": f"sqlite:///{database}",
        "REDIS_URL": redis.url,
        "SQLITE_BUSY_TIMEOUT_S": "0.2",
        "MAX_MEMBER_DATASETS": "2",
        "MAX_MEMBER_DATASET_BYTES": str(1 << 20),
        "MAX_MEMBER_CHECKPOINT_BYTES": str(1 << 20),
        "ALLOW_WAITING_FOR_NODES": "true",  # no worker here: a submitted run stays queued
    }.items():
        monkeypatch.setenv(f"TORCHYARD_{name}", value)
    for cached in (get_settings, get_engine, get_sessionmaker):
        cached.cache_clear()
    upgrade(get_settings().sqlalchemy_url)
    with transaction() as session:
        _token, value = create_token(session, "member", "member")
    client = TestClient(create_app(), headers={"Authorization": f"Bearer {value}"})
    try:
        yield client, database
    finally:
        client.close()
        get_engine().dispose()
        redis.stop()
        for cached in (get_settings, get_engine, get_sessionmaker):
            cached.cache_clear()


def test_a_locked_database_answers_503_with_retry_after_and_changes_nothing(api: tuple[TestClient, Path]) -> None:
    client, database = api
    holder = sqlite3.connect(database, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another writer, holding its lock past the busy timeout
    try:
        busy = client.post("/api/v1/datasets", json={"name": "shards"})
        assert busy.status_code == 503, busy.text
        assert busy.headers["Retry-After"] == "1" and "database is busy" in busy.json()["detail"]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    again = client.post("/api/v1/datasets", json={"name": "shards"})
    assert again.status_code == 201, again.text  # the first try left nothing behind (no 409)


def shard_of(size: int) -> bytes:
    body = io.BytesIO()
    with tarfile.open(fileobj=body, mode="w") as tar:
        info = tarfile.TarInfo("0001.bin")
        info.size = size
        tar.addfile(info, io.BytesIO(b"x" * size))
    return body.getvalue()


def test_a_member_cannot_own_datasets_past_their_count_or_bytes(api: tuple[TestClient, Path]) -> None:
    client, _database = api
    for name in ("a", "b"):
        assert client.post("/api/v1/datasets", json={"name": name}).status_code == 201
    third = client.post("/api/v1/datasets", json={"name": "c"})
    assert third.status_code == 429 and "owns 2 datasets" in third.json()["detail"], third.text
    first = client.put("/api/v1/datasets/a/shards/0", content=shard_of(700 << 10))
    assert first.status_code == 200, first.text
    again = client.put("/api/v1/datasets/a/shards/0", content=shard_of(700 << 10))  # replacing it counts once
    assert again.status_code == 200, again.text
    past = client.put("/api/v1/datasets/b/shards/0", content=shard_of(700 << 10))
    assert past.status_code == 413 and "TORCHYARD_MAX_MEMBER_DATASET_BYTES" in past.json()["detail"], past.text


def test_a_member_past_their_checkpoint_bytes_deletes_some_before_the_next_run(api: tuple[TestClient, Path]) -> None:
    client, _database = api
    first = client.post("/api/v1/runs", json=run_spec(name="first"))
    assert first.status_code == 201, first.text
    run_id = first.json()["id"]
    busy = client.delete(f"/api/v1/runs/{run_id}/checkpoints")
    assert busy.status_code == 409 and "once it has ended" in busy.json()["detail"], busy.text
    with transaction() as session:  # it ended, keeping 2 MiB of checkpoints (and a link to elsewhere)
        session.get(Run, run_id).status = "succeeded"  # type: ignore[union-attr]
    step = get_settings().checkpoints / str(run_id) / "step-10"
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(os.urandom(2 << 20))
    (step / "elsewhere").symlink_to(get_settings().state_dir, target_is_directory=True)
    refused = client.post("/api/v1/runs", json=run_spec(name="second"))
    assert refused.status_code == 429 and "TORCHYARD_MAX_MEMBER_CHECKPOINT_BYTES" in refused.json()["detail"]
    assert client.delete(f"/api/v1/runs/{run_id}/checkpoints").status_code == 204
    assert not step.exists() and get_settings().state_dir.is_dir()  # the link was removed, not followed
    assert client.post("/api/v1/runs", json=run_spec(name="second")).status_code == 201
