"""Fuzz the api from its own OpenAPI schema (schemathesis): whatever a client sends, no 5xx, and
every documented response matches its schema. The stack runs without a worker, so the runs the
fuzzer submits wait in the queue instead of training."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from backend.app import create_app
from testkit.stack import api_only_stack

pytestmark = pytest.mark.stack

schema = schemathesis.openapi.from_dict(create_app().openapi())


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    with api_only_stack(tmp_path_factory.mktemp("fuzz")) as running:
        yield running.url, running.token


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
