"""The dashboard in a real browser (Debian's headless Chromium driven by Playwright) against a
real stack (api, ingest, worker on SQLite): log in through the printed link, submit from the
form and watch the run live, cancel, compare, and see the server's 422 next to its field.
Screenshots of every page go to test-output/screenshots/."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunningStack, start_stack
from torchyard.procs import RedisServer

playwright_sync = pytest.importorskip("playwright.sync_api")
Page = playwright_sync.Page
expect = playwright_sync.expect

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "frontend" / "dist" / "index.html"
SHOTS = ROOT / "test-output" / "screenshots"

MISSING = [
    why
    for missing, why in (
        (not CHROMIUM.exists(), "apt-get install chromium chromium-driver"),
        (not DIST.exists(), "build the front end: cd frontend && npm ci && npm run build"),
    )
    if missing
]
if MISSING and os.environ.get("CI"):  # in CI a skipped browser test would hide a broken setup
    raise RuntimeError(f"the dashboard's browser tests need: {'; '.join(MISSING)}")
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))


@pytest.fixture(scope="module")
def ui_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    tmp = tmp_path_factory.mktemp("ui-stack")
    redis = RedisServer(tmp / "redis").start()
    running = start_stack(tmp, f"sqlite:///{tmp / 'torchyard.db'}", redis)
    yield running
    running.stack.stop()
    redis.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
        )
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, ui_stack: RunningStack) -> Iterator[Page]:
    """A logged-in page (through the link `torchyard up` prints), its console errors checked."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000}, base_url=ui_stack.url)
    context.set_default_timeout(30_000)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto(f"/#/login?token={ui_stack.token}")
    expect(pg.get_by_test_id("runs-table").or_(pg.get_by_text("No runs yet"))).to_be_visible()
    yield pg
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def shot(pg: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def set_field(pg: Page, name: str, value: str) -> None:
    field = pg.locator(f'[name="{name}"]')
    if field.evaluate("el => el.tagName") == "SELECT":
        field.select_option(value)
    else:
        field.fill(value)


@pytest.mark.timeout(60)
def test_login_through_the_printed_link_sets_an_httponly_cookie_and_logout_clears_it(
    browser: Any, ui_stack: RunningStack
) -> None:
    context = browser.new_context(viewport={"width": 1440, "height": 900}, base_url=ui_stack.url)
    pg = context.new_page()
    pg.goto("/#/runs")
    expect(pg.get_by_role("button", name="Sign in")).to_be_visible()  # no session: the login page
    shot(pg, "login")
    pg.get_by_label("Token").fill("ty_not_a_token")
    pg.get_by_role("button", name="Sign in").click()
    expect(pg.get_by_role("alert")).to_contain_text("unknown or revoked")

    pg.goto(f"/#/login?token={ui_stack.token}")
    pg.wait_for_url(re.compile(r"#/runs$"))  # the token leaves the address bar
    expect(pg.get_by_test_id("logout")).to_be_visible()
    (cookie,) = [c for c in context.cookies() if c["name"] == "torchyard_session"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

    pg.get_by_test_id("logout").click()
    expect(pg.get_by_role("button", name="Sign in")).to_be_visible()
    assert not [c for c in context.cookies() if c["name"] == "torchyard_session"]
    context.close()


@pytest.mark.timeout(150)
def test_a_run_submitted_from_the_form_is_watched_live_to_success(page: Page) -> None:
    page.goto("/#/new")
    set_field(page, "name", "ui-live")
    set_field(page, "workload.params.hidden", "32")
    set_field(page, "training.steps", "1500")
    set_field(page, "training.batch_size", "32")
    set_field(page, "resources.procs_per_node", "2")
    shot(page, "new-run")
    page.get_by_test_id("submit-run").click()
    page.wait_for_url(re.compile(r"#/runs/\d+$"))
    status = page.get_by_test_id("run-detail").get_by_test_id("status").first

    expect(status).to_have_text("running", timeout=60_000)
    # While it runs, the loss chart gains points from the live stream.
    points = page.get_by_test_id("loss-points")
    page.wait_for_function(
        "() => +document.querySelector('[data-testid=loss-points]').dataset.points > 20"
        " && document.querySelector('[data-testid=run-detail] [data-testid=status]').textContent === 'running'",
        timeout=60_000,
    )
    expect(page.get_by_test_id("chart-loss").locator("canvas")).to_be_visible()
    shot(page, "run-detail-running")
    expect(status).to_have_text("succeeded", timeout=90_000)
    expect(points).to_have_text("final")
    expect(page.get_by_test_id("rank-table").locator("tbody tr")).to_have_count(2)
    expect(page.get_by_test_id("events")).to_contain_text("succeeded")
    expect(page.get_by_test_id("spec-json")).to_contain_text('"ui-live"')
    shot(page, "run-detail")

    page.goto("/#/runs")
    expect(page.get_by_test_id("runs-table")).to_contain_text("ui-live")
    shot(page, "runs")


@pytest.mark.timeout(120)
def test_cancel_from_the_run_page(page: Page, ui_stack: RunningStack) -> None:
    run = ui_stack.client.submit(name="ui-cancel", steps=1_000_000, params={"hidden": 16})
    ui_stack.client.wait_status(run["id"], {"running"})
    page.goto(f"/#/runs/{run['id']}")
    page.get_by_test_id("cancel-run").click()
    expect(page.get_by_test_id("run-detail").get_by_test_id("status").first).to_have_text("cancelled", timeout=60_000)
    expect(page.get_by_test_id("cancel-run")).to_have_count(0)


@pytest.mark.timeout(120)
def test_compare_two_runs_overlays_charts_and_highlights_spec_differences(page: Page, ui_stack: RunningStack) -> None:
    a = ui_stack.client.submit(name="cmp-a", steps=60, params={"hidden": 16})
    b = ui_stack.client.submit(name="cmp-b", steps=60, params={"hidden": 32}, lr=0.05)
    for run in (a, b):
        ui_stack.client.wait_status(run["id"], {"succeeded"})
    page.goto("/#/runs")
    page.get_by_role("checkbox", name=f"pick run {a['id']} to compare").check()
    page.get_by_role("checkbox", name=f"pick run {b['id']} to compare").check()
    page.get_by_test_id("compare-picked").click()
    page.wait_for_url(re.compile(r"#/compare\?ids="))
    expect(page.get_by_test_id("compare-summary").locator("tbody tr")).to_have_count(2)
    differs = page.get_by_test_id("spec-diff").locator("tr.differs")
    expect(differs.filter(has_text="workload.params.hidden")).to_have_count(1)
    expect(differs.filter(has_text="training.lr")).to_have_count(1)
    expect(page.get_by_test_id("compare-loss").locator("canvas")).to_be_visible()
    shot(page, "compare")


@pytest.mark.timeout(60)
def test_a_bad_form_value_shows_the_servers_message_next_to_the_field(page: Page) -> None:
    page.goto("/#/new")
    set_field(page, "name", "ui-bad")
    # The browser checks what the schema says ...
    set_field(page, "training.batch_size", "63")
    set_field(page, "resources.procs_per_node", "2")
    page.get_by_test_id("submit-run").click()
    expect(page.get_by_test_id("error-training.batch_size")).to_contain_text("divisible")
    # ... and the server what only it knows: no node here has a GPU.
    set_field(page, "training.batch_size", "64")
    set_field(page, "resources.device", "cuda")
    page.get_by_test_id("submit-run").click()
    expect(page.get_by_test_id("error-resources.device")).to_contain_text("no node in the cluster has device 'cuda'")
    assert re.search(r"#/new$", page.url)
    shot(page, "new-run-error")


@pytest.mark.timeout(60)
def test_cluster_page_shows_the_node_and_its_slots(page: Page, ui_stack: RunningStack) -> None:
    page.goto("/#/cluster")
    expect(page.get_by_test_id("nodes")).to_contain_text(ui_stack.settings.node_id)
    expect(page.get_by_test_id("nodes")).to_contain_text("/ 4")
    shot(page, "cluster")
