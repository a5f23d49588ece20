"""Fuzz the api from its own OpenAPI schema (schemathesis): whatever a client sends, no 5xx, and
every documented response matches its schema. The stack runs without a worker, so the runs the
fuzzer submits wait in the queue instead of training."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from backend.app import create_app
from torchyard.local import Stack
from torchyard.procs import RedisServer, free_port
from torchyard.settings import Settings

schema = schemathesis.openapi.from_dict(create_app().openapi())


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    redis = RedisServer(tmp / "redis").start()
    token = f"ty_fuzz_{uuid.uuid4().hex}"
    stack = Stack(
        Settings(state_dir=tmp / "state", database_url=f"sqlite:///{tmp / 'db.sqlite'}", redis_url=redis.url,
                 port=free_port(), admin_token=token),
        processes=("api",),
    )  # fmt: skip
    stack.start()
    yield stack.settings.api_url, token
    stack.stop()
    redis.stop()


@pytest.mark.timeout(300)
@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_api_fail(case: schemathesis.Case, api: tuple[str, str]) -> None:
    if case.path.endswith("/stream"):
        return  # a live stream of a queued run never ends; its input checks are in test_api_errors
    url, token = api
    case.call_and_validate(
        base_url=url,
        headers={"Authorization": f"Bearer {token}"},
        checks=[not_a_server_error, response_schema_conformance],
    )
