"""The metrics SDK used inside each rank: ``log(step, **scalars)`` and ``flush()``.

``log`` appends to an in-memory bounded buffer and returns; it never touches Redis, never blocks
on it and never raises because of it. A daemon thread (started lazily, in the process that logs)
writes the buffer to the run's stream in batches: one XADD of a ``metrics`` entry (see
:mod:`torchyard.streams`) every ~0.2 s, or sooner when many points wait. When Redis is down the
batch is kept and retried with backoff; only when the buffer is full are the OLDEST points dropped,
and the running count goes out in the ``dropped`` field of the next batch. At exit the process
waits (bounded) until everything it logged is written.

Configuration comes from the environment the launcher sets:
``TORCHYARD_REDIS_URL``, ``TORCHYARD_RUN_ID``, ``TORCHYARD_ATTEMPT`` (default 1), ``RANK`` (default 0),
``TORCHYARD_SDK_BUFFER`` (points, default 1,000,000), ``TORCHYARD_SDK_EXIT_FLUSH_S`` (default 30).
Without the first two, ``log`` is a cheap no-op (with one warning).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import threading
import time
import warnings
from collections import deque
from typing import Any

from torchyard import streams

__all__ = ["flush", "log", "log_floats", "log_timeline"]

_log = logging.getLogger("torchyard.sdk")

FLUSH_INTERVAL_S = 0.2
WAKE_AT_POINTS = 2000  # wake the writer early when this many points wait
MAX_BATCH_POINTS = 5000  # points per XADD
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.05, 2.0

Point = tuple[int, float, dict[str, float]]


def _scalar(key: str, value: Any) -> float:
    if type(value) is float or type(value) is int:  # the common case, fast
        return float(value)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"torchyard.log: {key}={value!r} is not a number")
    try:
        return float(value)  # numpy scalars, one-element tensors, bool, Decimal, ...
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"torchyard.log: {key}={value!r} is not a number ({exc})") from None


class _Writer:
    """One per process: the buffer and the thread that drains it into one run's stream."""

    def __init__(self, url: str, run_id: int, attempt: int = 1, rank: int = 0, capacity: int = 1_000_000) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, not {capacity}")
        self.url, self.stream, self.attempt, self.rank = url, streams.run_stream(run_id), attempt, rank
        self.capacity = capacity
        self.pid = os.getpid()
        self._buf: deque[Point] = deque()
        self._head = 0  # sequence number of _buf[0]; points are numbered in log order from 0
        self._dropped = 0
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)  # append() takes the mutex itself: one frame less
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = self._connect()  # here, in the caller's thread: imports can fail at exit
        self._failing = False
        self.failures = 0  # failed writes so far (each retried)

    # -- the caller's side -------------------------------------------------------------------
    def append(self, step: int, values: dict[str, float]) -> None:
        point = (step, time.time(), values)
        with self._mutex:
            if len(self._buf) >= self.capacity:
                self._buf.popleft()
                self._head += 1
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 10_000 == 0:
                    _log.warning(
                        "torchyard: metrics buffer full (%d points): dropped %d oldest so far",
                        self.capacity,
                        self._dropped,
                    )
            self._buf.append(point)
            waiting = len(self._buf)
        if self._thread is None:
            self._start()
        if waiting >= WAKE_AT_POINTS and not self._wake.is_set():
            self._wake.set()

    def flush(self, timeout: float = 30.0) -> bool:
        """Waits until every point appended before the call has left the buffer (written, or
        dropped and counted); True if that happened within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._head + len(self._buf)
            if self._head >= target:
                return True
        if self._thread is None:
            self._start()
        self._wake.set()
        with self._cond:
            while self._head < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    @property
    def dropped(self) -> int:
        return self._dropped

    def pending(self) -> int:
        return len(self._buf)

    def _start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="torchyard-sdk-writer", daemon=True)
            self._thread.start()

    # -- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.0
        while True:
            if backoff:
                time.sleep(backoff)
            else:
                self._wake.wait(FLUSH_INTERVAL_S)
            self._wake.clear()
            try:
                while self._send_batch():
                    pass
            except Exception as exc:  # redis errors, OSError, anything: keep the points, retry
                self.failures += 1
                backoff = min(BACKOFF_MAX_S, backoff * 2 if backoff else BACKOFF_MIN_S)
                if not self._failing:
                    _log.warning("torchyard: writing metrics to %s failed (%s); retrying", self.stream, exc)
                self._failing = True
                self._disconnect()
            else:
                if self._failing:
                    _log.warning("torchyard: writing metrics to %s works again", self.stream)
                backoff, self._failing = 0.0, False

    def _send_batch(self) -> bool:
        """Writes the oldest points (one XADD); True when more are waiting."""
        with self._cond:
            if not self._buf:
                return False
            start = self._head
            points = list(itertools.islice(self._buf, MAX_BATCH_POINTS))
            dropped = self._dropped
        end = start + len(points)
        entry = {"attempt": self.attempt, "rank": self.rank, "points": points, "dropped": dropped}
        self._client.xadd(self.stream, streams.encode(streams.METRICS, entry))
        with self._cond:
            # Points of this batch dropped while it was in flight were written after all.
            self._dropped -= max(0, min(self._head, end) - start)
            for _ in range(max(0, end - self._head)):
                self._buf.popleft()
            self._head = max(self._head, end)
            self._cond.notify_all()
            return bool(self._buf)

    def send_timeline(self, step: int, timeline: dict[str, Any]) -> None:
        """One sampled step's timeline, written at once (a sample: on a Redis outage it is dropped
        with a warning, the step's figures go through the buffer like every point)."""
        entry = {"attempt": self.attempt, "rank": self.rank, "step": step, "timeline": timeline}
        try:
            self._client.xadd(self.stream, streams.encode(streams.PROFILE, entry))
        except Exception as error:
            _log.warning("torchyard: the timeline of step %d was not written: %s", step, error)

    def _connect(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No retries inside redis-py: this loop retries, with its own backoff.
        return redis.Redis.from_url(self.url, socket_timeout=10, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))

    def _disconnect(self) -> None:
        with contextlib.suppress(Exception):
            self._client.connection_pool.disconnect()  # the next command connects afresh


class _Disabled:
    """Stands in for the writer when the environment names no Redis or run."""

    pid = -1

    def append(self, step: int, values: dict[str, float]) -> None:
        pass

    def flush(self, timeout: float = 30.0) -> bool:
        return True

    def send_timeline(self, step: int, timeline: dict[str, Any]) -> None:
        pass


_writer: _Writer | _Disabled | None = None
_writer_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _writer_lock
    _writer_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def _from_env() -> _Writer | _Disabled:
    url, run_id = os.environ.get("TORCHYARD_REDIS_URL", ""), os.environ.get("TORCHYARD_RUN_ID", "")
    if not url or not run_id:
        warnings.warn(
            "torchyard.log: TORCHYARD_REDIS_URL or TORCHYARD_RUN_ID is not set; metrics are not recorded",
            RuntimeWarning,
            stacklevel=4,
        )
        return _Disabled()
    writer = _Writer(
        url,
        int(run_id),
        attempt=int(os.environ.get("TORCHYARD_ATTEMPT", "1")),
        rank=int(os.environ.get("RANK", "0")),
        capacity=int(os.environ.get("TORCHYARD_SDK_BUFFER", "1000000")),
    )
    atexit.register(_flush_at_exit, writer)
    return writer


def _flush_at_exit(writer: _Writer) -> None:
    if writer.pid != os.getpid():  # a forked child inherited the parent's handler
        return
    timeout = float(os.environ.get("TORCHYARD_SDK_EXIT_FLUSH_S", "30"))
    if not writer.flush(timeout):
        _log.warning("torchyard: %d metric points not written within %.0f s at exit", writer.pending(), timeout)


def _get() -> _Writer | _Disabled:
    global _writer
    writer = _writer
    if writer is None or (writer.pid != os.getpid() and not isinstance(writer, _Disabled)):
        with _writer_lock:
            # A forked child starts afresh: the parent's buffer and thread are not its own.
            if _writer is None or (_writer.pid != os.getpid() and not isinstance(_writer, _Disabled)):
                _writer = _from_env()
            writer = _writer
    return writer


def log(step: int, **scalars: Any) -> None:
    """Records ``scalars`` (numbers: int, float, numpy or one-element torch scalars; NaN and inf
    are kept) at ``step``. Returns at once; raises TypeError for a value that is not a number."""
    if type(step) is not int:
        try:
            step = step.__index__()
        except AttributeError:
            raise TypeError(f"torchyard.log: step={step!r} is not an integer") from None
    if not scalars:
        return
    values = {}
    for key, value in scalars.items():  # plain numbers inline: this runs every step of every rank
        values[key] = float(value) if type(value) is float or type(value) is int else _scalar(key, value)
    _get().append(step, values)


def log_floats(step: int, values: dict[str, float]) -> None:
    """``log`` for callers whose values are already plain floats (the training loop's own figures,
    every step of every rank): no checks, no copy; the caller hands ``values`` over."""
    _get().append(step, values)


def log_timeline(step: int, timeline: dict[str, Any]) -> None:
    """Records one sampled step's timeline (``workers.runtime.profiling.timeline``'s shape)."""
    _get().send_timeline(step, timeline)


def flush(timeout: float = 30) -> bool:
    """Waits until every point logged so far is written to Redis; True if done within ``timeout``."""
    writer = _writer
    if writer is None or writer.pid != os.getpid():
        return True
    return writer.flush(timeout)
