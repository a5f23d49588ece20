"""Waiting on conditions with a deadline (never sleep-and-hope): process start-up, tests, benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05) -> T:
    """Polls ``check`` until it returns something truthy; raises TimeoutError naming ``what``.
    An AssertionError from ``check`` is final (the condition can no longer hold) and goes up at once."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except AssertionError:
            raise
        except Exception as exc:  # the condition may raise until it holds (e.g. connection refused)
            last_error = exc
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout:.0f}s waiting for {what}"
                + (f" (last error: {last_error})" if last_error else "")
            )
        time.sleep(interval)
