"""Fixtures: real Redis (a private redis-server per stack), real PostgreSQL (a fresh database per
session on 127.0.0.1:5432), and a real stack of api, ingest and worker subprocesses (``testkit/stack.py``).
Each test module declares its tier with a marker (``stack``, ``dist``, ``browser``, ``netns``, ``chaos``, ``slurm``,
``tools``); a module without one is ``unit``, the tier ``scripts/test --fast`` runs. What a host may lack is
skipped, and fails under CI (``testkit/require.py``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy.orm import Session

from backend import lifecycle
from backend.db import make_engine
from backend.migrate import upgrade
from cli.redis_server import RedisServer
from testkit import browser as chromium
from testkit import require
from testkit.forked import Forked
from testkit.ingest import one_run
from testkit.stack import RunningStack, sqlite_stack, start_stack

PG_ADMIN_DSN = os.environ.get("TORCHYARD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def fresh_database() -> Iterator[str]:
    """A new, empty PostgreSQL database, dropped afterwards."""
    name = f"torchyard_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    yield f"{base}/{name}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL database for this test session's database-level tests."""
    with fresh_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def ingest_run(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[redis.Redis, int]]:
    """For ingest's tests: a migrated database as the process-wide one, a private Redis, and a scheduled run."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    with one_run(tmp_path, url, monkeypatch, lifecycle.SCHEDULED) as found:
        yield found


@pytest.fixture(scope="module")
def module_pg_url() -> Iterator[str]:
    """A PostgreSQL database of the module's own: a stack's nodes and runs never meet another module's
    (a lost node of an earlier stack would still count as one the cluster has)."""
    with fresh_database() as url:
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of the module's own, for ranks run without the platform (testkit/torchrun.py)."""
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def forked() -> Iterator[Forked]:
    """A warm interpreter that forks ranks (``testkit/forked.py``), one per test process."""
    warm = Forked()
    yield warm
    warm.close()


@contextmanager
def migrated_session(url: str) -> Iterator[Session]:
    upgrade(url)
    engine = make_engine(url)
    with Session(engine) as s:
        yield s
    engine.dispose()


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    """A session on a freshly migrated SQLite database of the test's own (the data layer alone)."""
    with migrated_session(f"sqlite:///{tmp_path / 'db.sqlite'}") as s:
        yield s


@pytest.fixture(params=["sqlite", "postgresql"])
def session_on_both(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Session]:
    """A session on each database in turn (the test runs twice): a freshly migrated SQLite file of
    the test's own, and the test session's PostgreSQL database. For code whose SQL the two spell
    differently; a module takes it as its ``session`` by overriding that fixture."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    with migrated_session(url) as s:
        yield s


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """A whole system per database kind: api (+scheduler), ingest and a worker as subprocesses."""
    tmp = tmp_path_factory.mktemp(f"stack-{request.param}")
    database_url = (
        f"sqlite:///{tmp / 'torchyard.db'}" if request.param == "sqlite" else request.getfixturevalue("module_pg_url")
    )
    redis = RedisServer(tmp / "redis").start()
    running = start_stack(tmp, database_url, redis, **request.getfixturevalue("stack_settings"))
    yield running
    running.stack.stop()
    redis.stop()


@pytest.fixture(scope="module")
def stack_settings() -> dict[str, Any]:
    """Settings the ``stack`` of a test module differs in (a module overrides this fixture)."""
    return {}


# What a test needs beyond this process (pyproject.toml).
TIERS = ("stack", "dist", "browser", "netns", "chaos", "slurm", "tools")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test of no other tier is ``unit``: in-process or a private Redis/PostgreSQL, seconds at most."""
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.unit)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """What the test's ``needs`` marks name as lacking: a skip, or under CI a failure."""
    require.check(item)


# The browser tests' fixtures (tests/test_ui*.py): one stack and one Chromium per module, and a
# logged-in page per test whose uncaught errors fail it.


@pytest.fixture(scope="module")
def ui_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(tmp_path_factory.mktemp("ui-stack")) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    playwright = chromium.sync_api()
    with playwright.sync_playwright() as p:
        b = chromium.launch(p)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, ui_stack: RunningStack) -> Iterator[Any]:
    """A logged-in page (through the link `torchyard up` prints), its console errors checked."""
    from playwright.sync_api import expect

    context = browser.new_context(
        viewport={"width": 1440, "height": 1000}, base_url=ui_stack.url, accept_downloads=True
    )
    context.set_default_timeout(30_000)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    # The api's Content-Security-Policy must not block anything the dashboard does.
    pg.on("console", lambda msg: errors.append(msg.text) if "Content Security Policy" in msg.text else None)
    pg.goto(f"/#/login?token={ui_stack.token}")
    expect(pg.get_by_test_id("runs-table").or_(pg.get_by_text("No runs yet"))).to_be_visible()
    yield pg
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture(scope="module")
def shared_runs() -> dict[str, int]:
    """Runs one test made and another reuses (a run costs seconds of process start-up)."""
    return {}
