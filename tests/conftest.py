"""Fixtures: real Redis (a private redis-server per stack), real PostgreSQL (a fresh database per
session on 127.0.0.1:5432), and a real stack of api, ingest and worker subprocesses."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from torchyard.local import Stack
from torchyard.procs import RedisServer, free_port, wait_for
from torchyard.settings import Settings

PG_ADMIN_DSN = os.environ.get("TORCHYARD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A new, empty PostgreSQL database for this test session, dropped at the end."""
    name = f"torchyard_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    yield f"{base}/{name}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


class Client:
    """The api as a test sees it: a bearer token and helpers that wait on conditions."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def submit(self, **overrides: Any) -> dict[str, Any]:
        response = self.http.post("/api/v1/runs", json=run_spec(**overrides))
        assert response.status_code == 201, response.text
        return dict(response.json())

    def run(self, run_id: int) -> dict[str, Any]:
        return dict(self.http.get(f"/api/v1/runs/{run_id}").raise_for_status().json())

    def wait_status(self, run_id: int, statuses: set[str], timeout: float = 90) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            run = self.run(run_id)
            if run["status"] in TERMINAL and run["status"] not in statuses:
                raise AssertionError(f"run {run_id} ended {run['status']}: {run['status_reason']}")
            return run if run["status"] in statuses else None

        return wait_for(reached, timeout, f"run {run_id} to become {'/'.join(sorted(statuses))}", interval=0.2)


def run_spec(
    name: str = "test-run",
    workload: str = "mlp",
    params: dict[str, Any] | None = None,
    procs: int = 2,
    steps: int = 50,
    batch_size: int = 64,
    **training: Any,
) -> dict[str, Any]:
    return {
        "name": name,
        "workload": {"kind": "builtin", "name": workload, "params": params or {}},
        "strategy": {"kind": "ddp"},
        "resources": {"nodes": 1, "procs_per_node": procs, "device": "cpu"},
        "training": {"steps": steps, "batch_size": batch_size, "lr": 0.01, "seed": 0, **training},
    }


class RunningStack:
    def __init__(self, stack: Stack, token: str, redis: RedisServer | None = None) -> None:
        self.stack, self.token, self.redis = stack, token, redis
        self.settings = stack.settings
        self.url = stack.settings.api_url
        self.client = Client(self.url, token)


def start_stack(tmp: Path, database_url: str, redis: RedisServer, **overrides: Any) -> RunningStack:
    settings = Settings(
        state_dir=tmp / "state",
        database_url=database_url,
        redis_url=redis.url,
        port=free_port(),
        admin_token=f"ty_test_{uuid.uuid4().hex}",
        node_id=f"node-{uuid.uuid4().hex[:6]}",
        node_slots=4,
        heartbeat_s=0.5,
        node_timeout_s=5,
        scheduler_interval_s=0.5,
        **overrides,
    )
    stack = Stack(settings)
    token = stack.start()
    running = RunningStack(stack, token, redis)
    wait_for(lambda: running.client.http.get("/api/v1/nodes").json(), 30, "the worker's first heartbeat")
    return running


@contextmanager
def sqlite_stack(tmp: Path, **overrides: Any) -> Iterator[RunningStack]:
    """A whole system on SQLite with a Redis of its own; every process of it (ranks too) ends on exit."""
    redis = RedisServer(tmp / "redis").start()
    try:
        running = start_stack(tmp, f"sqlite:///{tmp / 'torchyard.db'}", redis, **overrides)
        try:
            yield running
        finally:
            running.stack.stop()
    finally:
        redis.stop()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """A whole system per database kind: api (+scheduler), ingest and a worker as subprocesses."""
    tmp = tmp_path_factory.mktemp(f"stack-{request.param}")
    database_url = (
        f"sqlite:///{tmp / 'torchyard.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    )
    redis = RedisServer(tmp / "redis").start()
    running = start_stack(tmp, database_url, redis)
    yield running
    running.stack.stop()
    redis.stop()
