"""Whether a share must stop: the api's cancel (a key holding the run's cancel token; a key anyone
else set is ignored) or its attempt ended elsewhere (another node of its gang, the watchdog)."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any

import redis

from torchyard import streams
from workers.rundirs import write_marker

log = logging.getLogger(__name__)


CANCEL_MARKER = "cancel-requested"  # in TORCHYARD_RUN_DIR, written before the SIGTERM of a cancel


def mark_cancel(run_dir: Path, why: str) -> None:
    """Tells the ranks that the SIGTERM coming is a cancel (they may save first), and why (their log
    says it). Written as every platform marker in a run dir is (``rundirs.write_marker``: what the
    ranks left at its path is replaced, never written through). A marker that cannot be written (the
    ranks put a folder in its place) leaves a plain SIGTERM: the cancel still ends them."""
    try:
        write_marker(run_dir / CANCEL_MARKER, why)
    except OSError as exc:
        log.warning("run dir %s: no cancel marker (%s)", run_dir, exc)


_forged_cancels: set[int] = set()  # runs whose cancel key we ignored (warned once each)


def cancel_requested(client: redis.Redis, run_id: int, token: str | None) -> bool:
    """The api cancelled the run: its cancel key holds the run's cancel token. A key with any
    other value was set by someone else and is ignored (the run trains on). A task from a
    scheduler that sends no token obeys any key, as before."""
    try:
        value: Any = client.get(streams.cancel_key(run_id))
    except redis.RedisError:
        return False  # Redis briefly away: keep training, ask again next tick
    if value is None:
        return False
    if token is None or hmac.compare_digest(value, token.encode()):
        return True
    if run_id not in _forged_cancels:
        if len(_forged_cancels) >= 1000:  # bounded: at worst a warning is repeated
            _forged_cancels.clear()
        _forged_cancels.add(run_id)
        log.warning("run %s: ignoring a cancel key the api did not set", run_id)
    return False


def attempt_ended(client: redis.Redis, run_id: int, attempt: int) -> bool:
    try:
        return bool(client.exists(streams.attempt_end_key(run_id, attempt)))
    except redis.RedisError:
        return False
