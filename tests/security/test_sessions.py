"""Attacks on the browser's login, on a live stack (SQLite and PostgreSQL): the cookie is an
opaque, revocable session id, never the token; cookie-authenticated writes from another origin
are refused and leave the victim's run alone; logout and revocation end sessions and close live
streams; abruptly dropped streams give their quota back; no secret reaches a log or an error."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import create_engine, select, update
from sqlalchemy.orm import Session

from backend.models import BrowserSession, utcnow
from cli.wait import wait_for
from testkit.stack import RunningStack, run_spec
from torchyard.net import free_port
from torchyard.settings import settings_env

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]
COOKIE = "torchyard_session"


def new_token(stack: RunningStack, role: str = "member") -> tuple[int, str]:
    body = stack.client.http.post("/api/v1/tokens", json={"name": f"{role}-user", "role": role}).json()
    return body["id"], body["token"]


def login(stack: RunningStack, token: str) -> str:
    response = httpx.post(f"{stack.url}/api/v1/session", json={"token": token})
    assert response.status_code == 200, response.text
    return response.cookies[COOKIE]


def browser(stack: RunningStack, cookie: str, origin: str | None = None) -> httpx.Client:
    """What a browser sends: the cookie, and the page's origin (ours unless told otherwise)."""
    headers = {"Origin": origin or stack.url}
    return httpx.Client(base_url=stack.url, cookies={COOKIE: cookie}, headers=headers, timeout=30)


def session_rows(stack: RunningStack) -> list[BrowserSession]:
    engine = create_engine(stack.settings.sqlalchemy_url)
    with Session(engine) as db:
        rows = list(db.scalars(select(BrowserSession)))
    engine.dispose()
    return rows


@pytest.fixture(scope="module")
def stack_settings() -> dict[str, Any]:
    return {"allow_waiting_for_nodes": True}  # a cluster that may grow: queued_run's run waits


def queued_run(stack: RunningStack, token: str) -> int:
    """A run too big for the node: it stays queued (and its stream live) until cancelled."""
    response = httpx.post(
        f"{stack.url}/api/v1/runs", json=run_spec(procs=8), headers={"Authorization": f"Bearer {token}"}
    )
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def test_the_cookie_is_an_opaque_session_id_stored_only_as_its_hash(stack: RunningStack) -> None:
    _, token = new_token(stack)
    cookie = login(stack, token)
    assert token not in cookie and len(cookie) >= 40
    assert browser(stack, cookie).get("/api/v1/me").json()["role"] == "member"
    hashes = {row.id_hash for row in session_rows(stack)}
    assert hashlib.sha256(cookie.encode()).hexdigest() in hashes and cookie not in hashes


def test_a_cross_origin_write_with_the_cookie_is_refused_and_the_victim_run_is_untouched(
    stack: RunningStack,
) -> None:
    _, victim = new_token(stack)
    run_id = queued_run(stack, victim)
    cookie = login(stack, victim)
    evil = f"http://127.0.0.1:{free_port()}"  # another port of the same host: it gets our cookies
    cancel = f"/api/v1/runs/{run_id}/cancel"
    attempts = [
        browser(stack, cookie, origin=evil).post(cancel),
        browser(stack, cookie).post(cancel, headers={"Sec-Fetch-Site": "same-site"}),
        browser(stack, cookie).post(cancel, headers={"Sec-Fetch-Site": "cross-site"}),
        httpx.post(f"{stack.url}{cancel}", cookies={COOKIE: cookie}),  # neither header: not provably ours
        browser(stack, cookie, origin=evil).post("/api/v1/runs", json=run_spec()),
    ]
    for refused in attempts:
        assert refused.status_code == 403, refused.text
        assert "cross-origin" in refused.json()["detail"] and cookie not in refused.text
    login_from_evil = httpx.post(f"{stack.url}/api/v1/session", json={"token": victim}, headers={"Origin": evil})
    assert login_from_evil.status_code == 403 and victim not in login_from_evil.text
    assert stack.client.run(run_id)["status"] == "queued"

    # The same cookie from our own page works (reads need no origin: SameSite=Strict and CSP).
    assert browser(stack, cookie, origin=evil).get(f"/api/v1/runs/{run_id}").status_code == 200
    same_site = browser(stack, cookie).post(cancel, headers={"Sec-Fetch-Site": "same-origin"})
    assert same_site.status_code == 200 and same_site.json()["status"] == "cancelled"


def test_logout_ends_the_session_on_the_server(stack: RunningStack) -> None:
    _, token = new_token(stack)
    cookie = login(stack, token)
    page = browser(stack, cookie)
    logout = page.delete("/api/v1/session")
    assert logout.status_code == 204 and 'torchyard_session=""' in logout.headers["set-cookie"]
    replayed = browser(stack, cookie).get("/api/v1/me")  # a cookie kept (or stolen) before logout
    assert replayed.status_code == 401 and "sign in again" in replayed.json()["detail"]
    assert httpx.get(f"{stack.url}/api/v1/me", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_revoking_a_token_ends_its_sessions(stack: RunningStack) -> None:
    token_id, token = new_token(stack)
    cookies = [login(stack, token) for _ in range(2)]
    assert stack.client.http.delete(f"/api/v1/tokens/{token_id}").status_code == 204
    for cookie in cookies:
        assert browser(stack, cookie).get("/api/v1/me").status_code == 401


def test_an_expired_session_is_refused_and_its_row_deleted_at_the_next_login(stack: RunningStack) -> None:
    _, token = new_token(stack)
    cookie = login(stack, token)
    expired = hashlib.sha256(cookie.encode()).hexdigest()
    engine = create_engine(stack.settings.sqlalchemy_url)
    with Session(engine) as db, db.begin():
        db.execute(
            update(BrowserSession)
            .where(BrowserSession.id_hash == expired)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
    engine.dispose()
    assert browser(stack, cookie).get("/api/v1/me").status_code == 401
    login(stack, token)
    assert expired not in {row.id_hash for row in session_rows(stack)}


def test_every_response_carries_the_security_headers(stack: RunningStack) -> None:
    for response in (
        httpx.get(f"{stack.url}/healthz"),
        httpx.get(f"{stack.url}/api/v1/runs"),  # an error too
        stack.client.http.get("/api/v1/nodes"),
    ):
        csp = response.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "object-src 'none'" in csp
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"


def open_and_abort(stack: RunningStack, run_id: int, token: str, wait_for_status: bool = True) -> int:
    """Requests the run's stream on a raw socket and resets the connection (SO_LINGER 0: an RST,
    as when a browser tab or a network dies), after the status line or (``wait_for_status``
    False) at once, while the api is still authorising it. Returns the status code (0: none)."""
    url = urlsplit(stack.url)
    assert url.hostname and url.port
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(
            f"GET /api/v1/runs/{run_id}/stream HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        head = b""
        while wait_for_status and b"\r\n" not in head:
            head += sock.recv(1024)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return int(head.split()[1]) if head else 0


def open_and_close(stack: RunningStack, run_id: int, token: str) -> int:
    """Opens the run's stream with httpx and closes it after the first bytes."""
    url = f"{stack.url}/api/v1/runs/{run_id}/stream"
    with httpx.stream("GET", url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as response:
        if response.status_code == 200:
            next(response.iter_raw())
        return response.status_code


def test_streams_dropped_abruptly_give_their_quota_back(stack: RunningStack) -> None:
    limit = stack.settings.max_streams_per_token
    _, token = new_token(stack, "viewer")
    run_id = queued_run(stack, stack.token)
    for _ in range(limit + 4):  # without the quota back, the 17th would be a 429 until a restart
        open_and_abort(stack, run_id, token, wait_for_status=False)
    # The quota comes back once the api notices each client left: wait for that, not for time.
    for i in range(limit + 4):
        drop = open_and_close if i % 2 else open_and_abort
        wait_for(lambda drop=drop: drop(stack, run_id, token) == 200, 10, f"stream {i + 1} to open after drops")
    stack.client.http.post(f"/api/v1/runs/{run_id}/cancel")


def assert_stream_ends_after(stack: RunningStack, run_id: int, end_access: Callable[[], object], **client: Any) -> None:
    """Opens the run's stream, then calls ``end_access``: the server must end the stream. (It re-reads
    the credential every ``livefeed.RECHECK_S``; a minute here only keeps a stream that is never
    ended from hanging the test: keep-alives would come forever.)"""
    with (
        httpx.Client(base_url=stack.url, timeout=httpx.Timeout(10, read=10), **client) as http,
        http.stream("GET", f"/api/v1/runs/{run_id}/stream") as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_raw()
        next(chunks)
        end_access()
        guard = time.monotonic() + 60
        for _ in chunks:  # keep-alives until the server ends it
            assert time.monotonic() < guard, "the stream is still open a minute after its access ended"


def test_a_revoked_tokens_open_stream_closes(stack: RunningStack) -> None:
    token_id, token = new_token(stack, "viewer")
    run_id = queued_run(stack, stack.token)
    revoke = lambda: stack.client.http.delete(f"/api/v1/tokens/{token_id}").raise_for_status()  # noqa: E731
    assert_stream_ends_after(stack, run_id, revoke, headers={"Authorization": f"Bearer {token}"})

    _, token = new_token(stack, "viewer")
    cookie = login(stack, token)
    logout = lambda: browser(stack, cookie).delete("/api/v1/session").raise_for_status()  # noqa: E731
    assert_stream_ends_after(stack, run_id, logout, cookies={COOKIE: cookie})
    stack.client.http.post(f"/api/v1/runs/{run_id}/cancel")


def test_no_token_session_id_or_capability_reaches_the_log_or_an_error(stack: RunningStack, tmp_path: Path) -> None:
    """A second api process of the same stack, its output kept in a file."""
    port = free_port()
    log_file = tmp_path / "api.log"
    env = {**os.environ, **settings_env(stack.settings), "TORCHYARD_PORT": str(port)}
    with log_file.open("wb") as out:
        api = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "api", "--no-scheduler"], env=env, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200, 30, "the second api")
        _, token = new_token(stack)
        cookie = httpx.post(f"{url}/api/v1/session", json={"token": token}).cookies[COOKIE]
        secrets = [token, cookie, "ty_secret_in_query", "capsecret123"]
        responses = [
            httpx.get(f"{url}/api/v1/bundles/{'0' * 64}/download?cap=capsecret123"),
            httpx.get(f"{url}/api/v1/runs?token=ty_secret_in_query", cookies={COOKIE: cookie}),
            httpx.post(f"{url}/api/v1/session", json={"token": token + "x" * 500}),  # too long: 422
            httpx.post(f"{url}/api/v1/session", json={"tokn": token}),  # misspelt: 422
            httpx.get(f"{url}/api/v1/me", headers={"Authorization": f"Bearer {token}x"}),
            httpx.post(f"{url}/api/v1/runs", cookies={COOKIE: cookie}, headers={"Origin": "http://evil"}),
        ]
        assert [r.status_code for r in responses] == [403, 200, 422, 422, 401, 403]
        for response in responses:
            assert not [s for s in secrets if s in response.text], response.text
    finally:
        api.send_signal(signal.SIGTERM)
        api.wait(15)
    log = log_file.read_text()
    assert "/api/v1/bundles/" in log and "cap=[redacted]" in log, log  # the access log is on, and redacted
    assert not [s for s in secrets if s in log], log
