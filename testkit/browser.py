"""The dashboard in a real browser, for tests: Debian's headless Chromium driven by Playwright
(no downloaded browser), what it needs, and the helpers every browser test uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testkit.require import needs, require_module

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
DIST = ROOT / "frontend" / "dist" / "index.html"
SHOTS = ROOT / "test-output" / "screenshots"
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]


def missing() -> list[str]:
    """What the browser tests lack here, as the commands that fix it."""
    return [
        why
        for lacking, why in (
            (not CHROMIUM.exists(), "apt-get install chromium chromium-driver"),
            (not DIST.exists(), "build the front end: cd frontend && npm ci && npm run build"),
        )
        if lacking
    ]


def sync_api() -> Any:
    """Playwright's sync API (a dev dependency, ``playwright.sync_api``); without it the browser
    tests are skipped, and fail under CI (``testkit/require.py``)."""
    return require_module("playwright.sync_api", "Playwright drives Chromium: pip install -e '.[dev]'")


def launch(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=LAUNCH_ARGS)


def shot(page: Any, name: str) -> None:
    """A full-page screenshot into test-output/screenshots/<name>.png."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def set_field(page: Any, name: str, value: str) -> None:
    """Fill the new-run form's field ``name`` (a select, a checkbox or a text box)."""
    field = page.locator(f'[name="{name}"]')
    kind = field.evaluate("el => el.tagName === 'SELECT' ? 'select' : el.type")
    if kind == "select":
        field.select_option(value)
    elif kind == "checkbox":
        field.set_checked(value == "true")
    else:
        field.fill(value)


def browser_marks() -> list[Any]:
    """A browser test module's marks: the tier, and what this host lacks of Chromium and the built
    front end (``testkit/require.py``: a skip, and under CI a failure: a skipped browser test there
    would hide a broken setup)."""
    return [pytest.mark.browser, needs(*missing())]
