"""One leader at a time: a background loop whose passes run only in the process that holds a Redis
lock (the scheduler, the sweep controller). A pass that fails is logged and retried; the lock lapses
within a few intervals of its holder dying, and another process takes over."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)


def lead(
    client: redis.Redis,
    lock_name: str,
    interval_s: float,
    run_pass: Callable[[], object],
    wait: Callable[[float], None],
    stop: threading.Event,
    what: str,
) -> None:
    """Until ``stop``: take or keep the lock, run a pass while holding it, then ``wait(interval_s)``
    (which may return early: a wake-up list). The lock outlives five intervals (at least 10 s), so a
    slow pass does not lose it to another process mid-way."""
    lock = client.lock(lock_name, timeout=max(10.0, 5 * interval_s))
    name = uuid.uuid4().hex[:8]
    leader = False
    while not stop.is_set():
        try:
            leader = lock.reacquire() if leader else lock.acquire(blocking=False, token=name)
        except Exception:
            leader = False
        if leader:
            try:
                run_pass()
            except Exception:
                log.exception("%s pass failed; retrying", what)
        wait(interval_s)
