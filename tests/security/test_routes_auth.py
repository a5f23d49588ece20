"""Every route of the app needs a token, and the role its dependencies ask for: walked from the
route table itself, so a new route without an auth dependency fails here instead of shipping
open. Requests go to a real api process; the table comes from the same code."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, routing
from fastapi.dependencies.models import Dependant

from backend.app import create_app
from backend.deps import REQUIRED_ROLE, Viewer
from backend.security import ROLES
from testkit.stack import RunningStack, sqlite_stack

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]

# (method, path) that answer without a token: health checks, and the login exchange itself.
OPEN = {("GET", "/healthz"), ("GET", "/readyz"), ("POST", "/api/v1/session")}
PATH_VALUES = {"bundle_id": "0" * 64}  # every other path parameter is an id or a step: 1


def needed_role(dependant: Dependant) -> str | None:
    """The highest role any auth dependency of the route (at any depth) asks for."""
    found = [REQUIRED_ROLE[d.call] for d in _walk(dependant) if d.call in REQUIRED_ROLE]
    return max(found, key=ROLES.index) if found else None


def _walk(dependant: Dependant) -> Iterator[Dependant]:
    for sub in dependant.dependencies:
        yield sub
        yield from _walk(sub)


def protected_routes(app: FastAPI) -> list[tuple[str, str, str | None]]:
    """(method, path with values, role) for every route but the open ones, through the routers
    the app includes (FastAPI's own walk, the one its OpenAPI schema uses)."""
    out = []
    for route in routing.iter_route_contexts(app.routes):
        dependant = getattr(route, "dependant", None)
        if dependant is None:
            assert route.name == "frontend", f"{route.name}: not an api route, so its auth cannot be checked here"
            continue  # the built front end: static files, no data
        path = re.sub(r"{(\w+)}", lambda m: PATH_VALUES.get(m.group(1), "1"), route.path)
        out += [(m, path, needed_role(dependant)) for m in sorted(route.methods) if (m, route.path) not in OPEN]
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(tmp_path_factory.mktemp("routes-auth")) as running:
        yield running


def token(stack: RunningStack, role: str, revoked: bool = False) -> dict[str, str]:
    created = stack.client.http.post("/api/v1/tokens", json={"name": f"{role}-probe", "role": role}).json()
    if revoked:
        assert stack.client.http.delete(f"/api/v1/tokens/{created['id']}").status_code == 204
    return {"Authorization": f"Bearer {created['token']}"}


def test_every_route_needs_a_token_and_its_role(stack: RunningStack) -> None:
    routes = protected_routes(create_app())
    assert len(routes) > 20 and ("POST", "/api/v1/runs", "member") in routes
    open_routes = [(m, p) for m, p, role in routes if role is None]
    assert not open_routes, f"routes without an auth dependency (backend.deps.REQUIRED_ROLE): {open_routes}"

    callers = {
        "none": {},
        "revoked": token(stack, "admin", revoked=True),
        "viewer": token(stack, "viewer"),
        "member": token(stack, "member"),
    }
    wrong = []
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        for method, path, role in routes:
            assert role is not None
            expected = {"none": 401, "revoked": 401}
            expected |= {lower: 403 for lower in ROLES[: ROLES.index(role)] if lower in callers}
            for caller, status in expected.items():
                got = http.request(method, path, headers=callers[caller])
                if got.status_code != status:
                    wrong.append(f"{method} {path} ({role}) as {caller}: {got.status_code}, not {status}: {got.text}")
    assert not wrong, "\n".join(wrong)


def test_a_route_without_an_auth_dependency_is_caught() -> None:
    app = FastAPI(openapi_url=None)

    @app.get("/open")
    def open_route() -> None: ...

    @app.get("/guarded")
    def guarded(_viewer: Viewer) -> None: ...

    roles = {path: role for _, path, role in protected_routes(app)}
    assert roles == {"/open": None, "/guarded": "viewer"}
