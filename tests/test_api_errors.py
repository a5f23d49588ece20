"""Bad input gets a clear 4xx naming what is wrong: never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from testkit.stack import RunningStack, run_spec

# What the api answers to bad input is decided above the database: one stack, on SQLite.
pytestmark = [
    pytest.mark.stack,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("stack", ["sqlite"], indirect=True, scope="module"),
]


def post_run(stack: RunningStack, spec: dict[str, Any]) -> httpx.Response:
    return stack.client.http.post("/api/v1/runs", json=spec)


def test_every_endpoint_but_health_needs_a_valid_token(stack: RunningStack) -> None:
    anonymous = httpx.Client(base_url=stack.url)
    assert anonymous.get("/healthz").status_code == 200
    assert anonymous.get("/readyz").status_code == 200
    for method, path in [
        ("GET", "/api/v1/runs"),
        ("POST", "/api/v1/runs"),
        ("GET", "/api/v1/runs/1"),
        ("GET", "/api/v1/runs/1/metrics?key=loss"),
        ("GET", "/api/v1/runs/1/stream"),
        ("POST", "/api/v1/runs/1/cancel"),
        ("GET", "/api/v1/nodes"),
    ]:
        response = anonymous.request(method, path)
        assert response.status_code == 401, (method, path, response.status_code)
        assert "token" in response.json()["detail"]
    wrong = anonymous.get("/api/v1/runs", headers={"Authorization": "Bearer ty_not_a_token"})
    assert wrong.status_code == 401


def test_unknown_run_is_404(stack: RunningStack) -> None:
    for path in [
        "/api/v1/runs/999999",
        "/api/v1/runs/999999/events",
        "/api/v1/runs/999999/metrics?key=loss",
        "/api/v1/runs/999999/logs",
        "/api/v1/runs/999999/stream",
    ]:
        response = stack.client.http.get(path)
        assert response.status_code == 404, path
        assert "999999" in response.json()["detail"]
    assert stack.client.http.post("/api/v1/runs/999999/cancel").status_code == 404


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda s: s["workload"].update(name="resnet9000"), "workload", "resnet9000"),
        (lambda s: s["strategy"].update(kind="magic"), "strategy", "magic"),
        (lambda s: s["resources"].update(procs_per_node=0), "procs_per_node", "greater than or equal to 1"),
        (lambda s: s["training"].update(steps=0), "steps", "greater than or equal to 1"),
        (lambda s: s["resources"].update(device="cuda"), "device", "no node in the cluster has device 'cuda'"),
        (lambda s: s["resources"].update(device="tpu"), "device", "tpu"),
        (lambda s: s.update(colour="blue"), "colour", "Extra inputs are not permitted"),
        (lambda s: s["workload"]["params"].update(hiden=3), "hiden", "Extra inputs are not permitted"),
        (lambda s: s["training"].update(batch_size=63), "batch_size", "divisible"),
        (lambda s: s["training"].update(lr="fast"), "lr", "fast"),
    ],
)
def test_bad_spec_is_422_naming_the_field_and_value(stack: RunningStack, change: Any, field: str, words: str) -> None:
    spec = run_spec()
    change(spec)
    response = post_run(stack, spec)
    assert response.status_code == 422, response.text
    assert field in response.text and words in response.text


def test_a_rule_across_fields_names_its_field_and_echoes_only_its_value(stack: RunningStack) -> None:
    spec = run_spec()
    spec["training"]["batch_size"] = 63
    response = post_run(stack, spec)
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "training", "batch_size"], error
    assert error["input"] == 63, "the value, not the whole spec"
    assert "nodes × procs_per_node (2)" in error["msg"]


def test_malformed_json_and_bad_queries_are_4xx(stack: RunningStack) -> None:
    response = stack.client.http.post(
        "/api/v1/runs", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert stack.client.http.get("/api/v1/runs", params={"status": "sleeping"}).status_code == 422
    assert stack.client.http.get("/api/v1/runs", params={"limit": 0}).status_code == 422
    run = stack.client.submit(name="queries", steps=2)
    assert stack.client.http.get(f"/api/v1/runs/{run['id']}/metrics").status_code == 422  # key is required
    bad_resume = stack.client.http.get(f"/api/v1/runs/{run['id']}/stream", headers={"Last-Event-ID": "yesterday"})
    assert bad_resume.status_code == 422 and "yesterday" in bad_resume.text
    stack.client.wait_status(run["id"], {"succeeded"})


def test_a_run_too_big_for_every_node_is_422_naming_the_field_and_the_largest_node(stack: RunningStack) -> None:
    node = stack.settings.node_id
    for resources, field, words in [
        (
            {"procs_per_node": 16},
            "procs_per_node",
            f"resources.procs_per_node (16): the largest node, {node}, has 4 slots",
        ),
        (
            {"procs_per_node": 2, "nodes": 2},
            "nodes",
            f"resources.nodes (2) × procs_per_node (2): only 1 node(s) have 2 slots: {node}",
        ),
    ]:
        spec = run_spec(name="too-big", batch_size=64)
        spec["resources"].update(resources)
        response = post_run(stack, spec)
        assert response.status_code == 422, response.text
        (error,) = response.json()["detail"]
        assert error["loc"] == ["body", "resources", field] and words in error["msg"], error
