"""Roles, tokens, limits and the Prometheus endpoint, on a real stack with small limits and a
cluster that may grow (TORCHYARD_ALLOW_WAITING_FOR_NODES: a run bigger than its one node waits)."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator

import httpx
import pytest

from testkit.stack import Client, RunningStack, run_spec, sqlite_stack

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(
        tmp_path_factory.mktemp("hardening"),
        max_runs_in_flight=2,
        max_streams_per_token=2,
        max_request_bytes=8192,
        allow_waiting_for_nodes=True,
    ) as running:
        yield running


def new_token(stack: RunningStack, name: str, role: str) -> tuple[int, Client]:
    response = stack.client.http.post("/api/v1/tokens", json={"name": name, "role": role})
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["token"].startswith("ty_") and body["role"] == role
    return body["id"], Client(stack.url, body["token"])


def test_roles_decide_who_may_read_submit_cancel_and_manage_tokens(stack: RunningStack) -> None:
    _, viewer = new_token(stack, "watcher", "viewer")
    _, alice = new_token(stack, "alice", "member")
    _, bob = new_token(stack, "bob", "member")

    assert viewer.http.get("/api/v1/runs").status_code == 200
    refused = viewer.http.post("/api/v1/runs", json=run_spec(procs=8))
    assert refused.status_code == 403 and "member" in refused.json()["detail"]

    run = alice.submit(name="alices", procs=8)  # too big for the node, which may grow: it waits, queued
    not_yours = bob.http.post(f"/api/v1/runs/{run['id']}/cancel")
    assert not_yours.status_code == 403 and "not yours" in not_yours.json()["detail"]
    assert stack.client.http.post(f"/api/v1/runs/{run['id']}/cancel").json()["status"] == "cancelled"  # admin

    assert alice.http.get("/api/v1/tokens").status_code == 403
    assert alice.http.post("/api/v1/tokens", json={"name": "x", "role": "admin"}).status_code == 403
    listed = stack.client.http.get("/api/v1/tokens").json()
    assert {"watcher", "alice", "bob"} <= {t["name"] for t in listed}
    assert all("token" not in t and "token_hash" not in t for t in listed), "secrets are never listed"
    bad_role = stack.client.http.post("/api/v1/tokens", json={"name": "x", "role": "root"})
    assert bad_role.status_code == 422 and "root" in bad_role.text


def test_the_cli_creates_lists_and_revokes_tokens(stack: RunningStack) -> None:
    from click.testing import CliRunner

    from cli.main import main

    api = ["--api-url", stack.url, "--token", stack.token]
    created = CliRunner().invoke(main, ["token", "create", "--name", "ci-bot", "--role", "viewer", *api])
    assert created.exit_code == 0, created.output
    token_id = int(created.output.split()[1])
    listed = CliRunner().invoke(main, ["token", "list", *api])
    assert "ci-bot" in listed.output and "active" in listed.output
    revoked = CliRunner().invoke(main, ["token", "revoke", str(token_id), *api])
    assert revoked.exit_code == 0 and "revoked" in revoked.output
    twice = CliRunner().invoke(main, ["token", "revoke", str(token_id), *api])
    assert twice.exit_code != 0 and "409" in twice.output and "already revoked" in twice.output
    # By name, as README shows it: one active token of that name is revoked; none or two are an error.
    created = CliRunner().invoke(main, ["token", "create", "--name", "ci-bot", "--role", "viewer", *api])
    by_name = CliRunner().invoke(main, ["token", "revoke", "ci-bot", *api])
    assert by_name.exit_code == 0 and f"token {created.output.split()[1]} revoked" in by_name.output, by_name.output
    none_left = CliRunner().invoke(main, ["token", "revoke", "ci-bot", *api])
    assert none_left.exit_code != 0 and "0 active tokens are named 'ci-bot'" in none_left.output
    for _ in range(2):
        CliRunner().invoke(main, ["token", "create", "--name", "twin", *api])
    ambiguous = CliRunner().invoke(main, ["token", "revoke", "twin", *api])
    assert ambiguous.exit_code != 0 and "2 active tokens are named 'twin'" in ambiguous.output


def test_a_revoked_token_stops_working_at_once(stack: RunningStack) -> None:
    token_id, carol = new_token(stack, "carol", "member")
    assert carol.http.get("/api/v1/runs").status_code == 200
    assert stack.client.http.delete(f"/api/v1/tokens/{token_id}").status_code == 204
    assert carol.http.get("/api/v1/runs").status_code == 401
    again = stack.client.http.delete(f"/api/v1/tokens/{token_id}")
    assert again.status_code == 409 and "already revoked" in again.json()["detail"]
    assert stack.client.http.delete("/api/v1/tokens/999999").status_code == 404


def test_open_live_streams_hold_no_database_connection(stack: RunningStack) -> None:
    run = stack.client.submit(name="watched", procs=8)  # waits for a node: its stream stays open
    viewers = [new_token(stack, f"viewer-{i}", "viewer")[1] for i in range(10)]
    try:
        with contextlib.ExitStack() as open_streams:
            for viewer in viewers:  # 20 streams: more than a pool of 15 database connections (the old one)
                for _ in range(stack.settings.max_streams_per_token):
                    stream = viewer.http.stream("GET", f"/api/v1/runs/{run['id']}/stream", params={"since": "$"})
                    assert open_streams.enter_context(stream).status_code == 200
            # Had the streams held the pool's connections, this request would wait out the pool's
            # 30 s timeout and get a 500 (or this client's 30 s timeout first): a failure either way.
            assert stack.client.http.get(f"/api/v1/runs/{run['id']}").status_code == 200
    finally:
        stack.client.http.post(f"/api/v1/runs/{run['id']}/cancel")


def test_a_burst_of_requests_is_served_without_waiting_on_the_pool(stack: RunningStack) -> None:
    """More requests at once than the api has threads (40): none may wait for a connection that a
    request waiting for its next thread holds (each sync dependency runs on a thread of its own)."""
    run = stack.client.submit(name="popular", procs=8)

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=None)
        headers = {"Authorization": f"Bearer {stack.token}"}
        async with httpx.AsyncClient(base_url=stack.url, headers=headers, limits=limits, timeout=60) as client:
            got = await asyncio.gather(*(client.get(f"/api/v1/runs/{run['id']}") for _ in range(150)))
        return [response.status_code for response in got]

    try:  # a request that waited on the pool would get its 500 after the pool's 30 s timeout
        assert asyncio.run(burst()) == [200] * 150
    finally:
        stack.client.http.post(f"/api/v1/runs/{run['id']}/cancel")


def test_limits_are_clear_4xx(stack: RunningStack) -> None:
    _, dave = new_token(stack, "dave", "member")
    too_big = dave.http.post(
        "/api/v1/runs", content=b"{" + b" " * 10_000 + b"}", headers={"Content-Type": "application/json"}
    )
    assert too_big.status_code == 413

    waiting = [dave.submit(name=f"wait-{i}", procs=8) for i in range(2)]
    third = dave.http.post("/api/v1/runs", json=run_spec(procs=8))
    assert third.status_code == 429 and "2 unfinished runs" in third.json()["detail"]

    run_id = waiting[0]["id"]
    headers = {"Authorization": f"Bearer {dave.http.headers['Authorization'][7:]}"}
    url = f"{stack.url}/api/v1/runs/{run_id}/stream"
    timeout = httpx.Timeout(10, read=30)
    with (
        httpx.stream("GET", url, headers=headers, timeout=timeout) as first,
        httpx.stream("GET", url, headers=headers, timeout=timeout) as second,
    ):
        assert first.status_code == second.status_code == 200
        third_stream = httpx.get(url, headers=headers, timeout=timeout)
        assert third_stream.status_code == 429 and "live streams" in third_stream.json()["detail"]

    for run in waiting:
        dave.http.post(f"/api/v1/runs/{run['id']}/cancel")
    assert dave.http.post("/api/v1/runs", json=run_spec(procs=8)).status_code == 201  # under the limit again


def test_a_run_too_big_for_every_node_waits_with_a_warning_when_nodes_may_join_and_cancels_at_once(
    stack: RunningStack,
) -> None:
    from cli.wait import wait_for

    run = stack.client.submit(name="too-big", procs=8)
    node = stack.settings.node_id
    assert run["status"] == "queued"
    assert run["warnings"] == [
        f"resources.procs_per_node (8): the largest node, {node}, has 4 slots; "
        "it waits for such nodes to join (TORCHYARD_ALLOW_WAITING_FOR_NODES)"
    ]
    assert stack.client.run(run["id"])["warnings"] == run["warnings"]  # kept on the run
    reason = wait_for(
        lambda: "needs 8 slots" in (r := stack.client.run(run["id"]))["status_reason"] and r,
        30,
        "the scheduler's reason",
    )["status_reason"]
    assert f"the largest, {node}, has 4" in reason, reason
    cancelled = stack.client.http.post(f"/api/v1/runs/{run['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert stack.client.http.post(f"/api/v1/runs/{run['id']}/cancel").status_code == 409


def test_prometheus_metrics_describe_runs_queue_nodes_and_ingest(stack: RunningStack) -> None:
    assert httpx.get(f"{stack.url}/metrics").status_code == 401
    done = stack.client.submit(name="counted", steps=5, procs=1, batch_size=8)
    stack.client.wait_status(done["id"], {"succeeded"})
    text = stack.client.http.get("/metrics").text

    def value(pattern: str) -> float:
        match = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
        assert match, f"{pattern} not in:\n{text}"
        return float(match.group(1))

    assert value(r'torchyard_runs\{status="succeeded"\}') >= 1
    assert value(r'torchyard_runs\{status="queued"\}') == value("torchyard_queue_depth")
    assert value(r'torchyard_nodes\{status="alive"\}') == 1
    assert value("torchyard_slots") == 4
    assert 0 <= value("torchyard_slots_free") <= 4
    assert value("torchyard_ingest_points_total") >= 5 * 4  # 5 steps x 4+ keys of the run above
    assert value("torchyard_stream_backlog_entries") >= 0
    assert "# TYPE torchyard_ingest_points_total counter" in text
