"""Fuzz the api from its own OpenAPI schema (schemathesis): whatever a client sends, no 5xx, and
every documented response matches its schema, the live streams' (Server-Sent Events) included. The
stack runs without a worker, so the runs the fuzzer submits wait in the queue instead of training."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from backend.app import create_app
from testkit.stack import api_only_stack, run_spec

pytestmark = pytest.mark.stack
# A live stream (of a run the fuzzer queued: it never ends) is read for this long, in all, and cut
# short (schemathesis reads an event stream until its request timeout, the whole of it, passes).
STREAM_READ_S = 2.0

schema = schemathesis.openapi.from_dict(create_app().openapi())


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    with api_only_stack(tmp_path_factory.mktemp("fuzz")) as running:
        yield running.url, running.token


@pytest.mark.timeout(120)
@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_api_fail(case: schemathesis.Case, api: tuple[str, str]) -> None:
    url, token = api
    live = case.path.endswith("/stream")
    response = case.call_and_validate(
        base_url=url,
        headers={"Authorization": f"Bearer {token}"},
        checks=[not_a_server_error, response_schema_conformance],
        timeout=STREAM_READ_S if live else 30,
    )
    if live and response.status_code == 200:  # read as an event stream, cut short: never to its end
        assert response.headers["content-type"][0].startswith("text/event-stream"), response.headers


@pytest.fixture(scope="module")
def queued_run(api: tuple[str, str]) -> int:
    """A run that waits in the queue (no worker): its live stream never ends."""
    url, token = api
    made = httpx.post(
        f"{url}/api/v1/runs", json=run_spec(name="fuzzed-stream", procs=1), headers={"Authorization": f"Bearer {token}"}
    )
    assert made.status_code == 201, made.text
    return int(made.json()["id"])


@pytest.mark.timeout(120)
@given(case=schema["/api/v1/runs/{run_id}/stream"]["GET"].as_strategy())
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_resume_point_makes_a_live_stream_fail_and_it_is_read_bounded(
    case: schemathesis.Case, api: tuple[str, str], queued_run: int
) -> None:
    # The fuzzer above rarely names a run that exists: here every case streams one, with its
    # fuzzed since and Last-Event-ID.
    url, token = api
    case.path_parameters = {"run_id": queued_run}
    response = case.call_and_validate(
        base_url=url,
        headers={"Authorization": f"Bearer {token}"},
        checks=[not_a_server_error, response_schema_conformance],
        timeout=STREAM_READ_S,
    )
    assert response.status_code in (200, 422), response.status_code
    if response.status_code == 200:
        assert response.headers["content-type"][0].startswith("text/event-stream"), response.headers
        assert response.stream_cut_short, "a queued run's stream ends only when the read stops"
