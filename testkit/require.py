"""What a test needs that a host may lack (Chromium, the built front end, Playwright, docker-compose,
Slurm's daemons, moto's server): without it the test is skipped, saying what to install, except
under CI (the environment variable ``CI`` set, as ``.ci/run`` sets it), where it fails: CI installs
all of it, so a skip there would hide a broken setup. A capability a host lacks on purpose (root,
CUDA) is a plain ``skipif`` instead, in CI too."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def lacking(why: str) -> NoReturn:
    """Skip the test (or the module, at its top) saying ``why``; under CI, fail it."""
    if in_ci():
        pytest.fail(f"CI lacks what this test needs (a broken setup, not a skip): {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


def require(condition: object, why: str) -> None:
    """Go on where ``condition`` holds; else ``lacking(why)``."""
    if not condition:
        lacking(why)


def require_module(name: str, why: str) -> ModuleType:
    """The module ``name`` imported; else ``lacking`` (``pytest.importorskip``, failing under CI)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        lacking(f"{why} ({exc})")


def needs(*missing: str) -> pytest.MarkDecorator:
    """A test's or a module's mark naming what this host lacks (none: nothing), for marks computed
    at import: ``check`` turns it into ``lacking`` at each test's setup, so a deselected test
    (``-m unit``) never fails for it, even under CI."""
    return pytest.mark.needs(*missing)


def check(item: pytest.Item) -> None:
    """The ``needs`` marks of ``item`` (tests/conftest.py calls this before each test's setup)."""
    missing = [why for mark in item.iter_markers("needs") for why in mark.args]
    require(not missing, "; ".join(missing))
