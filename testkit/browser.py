"""The dashboard in a real browser, for tests: Debian's headless Chromium driven by Playwright
(no downloaded browser), what it needs, and the helpers every browser test uses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

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
    """A browser test module's marks: the tier, and a skip where Chromium or the built front end is
    missing (in CI that is an error: a skipped browser test would hide a broken setup)."""
    lacking = missing()
    if lacking and os.environ.get("CI"):
        raise RuntimeError(f"the dashboard's browser tests need: {'; '.join(lacking)}")
    return [pytest.mark.browser, pytest.mark.skipif(bool(lacking), reason="; ".join(lacking))]
