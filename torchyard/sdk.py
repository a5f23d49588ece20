"""The metrics SDK used inside each rank: ``log(step, **scalars)`` and ``flush()``.

``log`` appends to an in-memory bounded buffer and returns; it never touches Redis, never blocks
on it and never raises because of it. A daemon thread (started lazily, in the process that logs)
writes the buffer to the run's stream in batches, each one XADD of a ``metrics`` entry (see
:mod:`torchyard.streams`), the way Nagle's algorithm batches a socket: the first point after a
quiet spell goes at once (live charts see it within a round trip); points that arrive while a
write is in flight go together in the next one, at most one write per ``BATCH_WINDOW_S`` unless
``WAKE_AT_POINTS`` wait. Sampled steps' timelines and the attempt's facts go through the same thread
(a bounded queue), so no call here ever waits on Redis. When Redis is down the
batch is kept and retried with backoff; only when the buffer is full are the OLDEST points dropped,
and the running count goes out in the ``dropped`` field of the next batch. At exit the process
waits (bounded) until everything it logged is written.

Configuration comes from the environment the launcher sets:
``TORCHYARD_RANK_REDIS_URL`` (the attempt's own Redis user: it may only XADD to the run's rank
stream ``ty:run:<id>:in``), ``TORCHYARD_RUN_ID``, ``TORCHYARD_ATTEMPT`` (default 1), ``RANK`` (default 0),
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

__all__ = ["flush", "log", "log_facts", "log_floats", "log_timeline"]

_log = logging.getLogger("torchyard.sdk")

BATCH_WINDOW_S = 0.02  # under steady logging, at most one write per this (a write costs ~0.2 ms of CPU)
IDLE_WAIT_S = 1.0  # an idle writer is woken by the next point; this is only its safety net
WAKE_AT_POINTS = 2000  # write before the window ends when this many points wait
ENTRY_QUEUE = 8  # timelines (and facts) waiting to be written; more: the oldest is dropped
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


def _yield_gil() -> None:
    time.sleep(0)  # releases the GIL: a thread waiting in log() takes it now, not after the 5 ms switch interval


class _Writer:
    """One per process: the buffer and the thread that drains it into one run's stream."""

    def __init__(self, url: str, run_id: int, attempt: int = 1, rank: int = 0, capacity: int = 1_000_000) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, not {capacity}")
        self.url, self.stream, self.attempt, self.rank = url, streams.rank_stream(run_id), attempt, rank
        self.capacity = capacity
        self.pid = os.getpid()
        self._buf: deque[Point] = deque()
        self._head = 0  # sequence number of _buf[0]; points are numbered in log order from 0
        self._dropped = 0
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)  # append() takes the mutex itself: one frame less
        self._wake = threading.Event()
        self._idle = False  # the writer waits with nothing to send: the next point wakes it
        self._entries: deque[tuple[str, dict[str, Any]]] = deque()  # (type, data): profiles, facts
        self._encoded: tuple[int, int, int, dict[Any, Any]] | None = (
            None  # (head, dropped, end, fields) of the batch in flight
        )
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
            idle, self._idle = self._idle, False
        if self._thread is None:
            self._start()
        if (idle or waiting >= WAKE_AT_POINTS) and not self._wake.is_set():
            self._wake.set()

    def flush(self, timeout: float = 30.0) -> bool:
        """Waits until every point appended before the call has left the buffer (written, or
        dropped and counted); True if that happened within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._head + len(self._buf)
            if self._head >= target and not self._entries:
                return True
        if self._thread is None:
            self._start()
        self._wake.set()
        with self._cond:
            while self._head < target or self._entries:
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
        backoff, last_write = 0.0, 0.0
        while True:
            if backoff:
                time.sleep(backoff)
            else:
                with self._cond:
                    self._idle = not self._buf and not self._entries
                    idle = self._idle
                if idle:
                    self._wake.wait(IDLE_WAIT_S)
                else:  # points came while the last write was in flight: let the batch fill a moment
                    self._wake.wait(max(0.0, last_write + BATCH_WINDOW_S - time.monotonic()))
            self._wake.clear()
            try:
                self._send_entries()
                while self._send_batch():
                    pass
                last_write = time.monotonic()
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
            dropped = self._dropped
            encoded = self._encoded if self._encoded and self._encoded[:2] == (start, dropped) else None
            if encoded is None:
                points = list(itertools.islice(self._buf, MAX_BATCH_POINTS))
        if encoded is None:  # a batch that failed is sent again as it was encoded (no re-encoding per retry)
            header = {"attempt": self.attempt, "rank": self.rank, "dropped": dropped}
            fields = streams.encode_metrics(header, points, pause=_yield_gil)
            encoded = self._encoded = (start, dropped, start + len(points), fields)
        end, fields = encoded[2], encoded[3]
        self._client.xadd(self.stream, fields)
        self._encoded = None
        with self._cond:
            # Points of this batch dropped while it was in flight were written after all.
            self._dropped -= max(0, min(self._head, end) - start)
            for _ in range(max(0, end - self._head)):
                self._buf.popleft()
            self._head = max(self._head, end)
            self._cond.notify_all()
            return bool(self._buf)

    def send_timeline(self, step: int, timeline: dict[str, Any]) -> None:
        """Queues one sampled step's timeline for the writer thread (a sample: when more than
        ENTRY_QUEUE wait, during a Redis outage, the oldest is dropped with a warning)."""
        self.send(streams.PROFILE, {"step": step, "timeline": timeline})

    def send(self, entry_type: str, data: dict[str, Any]) -> None:
        """Queues one entry of ``entry_type`` (this rank's attempt and rank added) for the writer thread."""
        entry = {"attempt": self.attempt, "rank": self.rank, **data}
        with self._cond:
            if len(self._entries) >= ENTRY_QUEUE:
                kind, old = self._entries.popleft()
                _log.warning("torchyard: a %s entry (step %s) was dropped (Redis is behind)", kind, old.get("step"))
            self._entries.append((entry_type, entry))
        if self._thread is None:
            self._start()
        self._wake.set()

    def _send_entries(self) -> None:
        while True:
            with self._cond:
                if not self._entries:
                    return
                queued = self._entries[0]
            self._client.xadd(self.stream, streams.encode(*queued))
            with self._cond:
                if self._entries and self._entries[0] is queued:
                    self._entries.popleft()
                self._cond.notify_all()

    def _connect(self) -> Any:
        # socket.getaddrinfo imports the idna codec on its first call. Were that import in flight on
        # the writer thread when the process forks (a DataLoader worker), the child would inherit
        # its module lock held and hang at its own first connect: import it here, in the caller's.
        import encodings.idna  # noqa: F401

        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No retries inside redis-py: this loop retries, with its own backoff. RESP2 and no driver info:
        # the rank's Redis user may run XADD only, and so the handshake sends nothing else (RESP3's
        # CLIENT commands would each be refused and logged by Redis).
        return redis.Redis.from_url(
            self.url,
            socket_timeout=10,
            socket_connect_timeout=2,
            retry=Retry(NoBackoff(), 0),
            protocol=2,
            driver_info=None,
        )

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

    def send(self, entry_type: str, data: dict[str, Any]) -> None:
        pass


_writer: _Writer | _Disabled | None = None
_writer_lock = threading.Lock()
_logs_own_loss = False  # the script logs "loss" itself: an unmodified script's captured loss stands aside


def logs_own_loss() -> bool:
    """Whether this process has logged a ``loss`` through :func:`log` (workers/runtime/autoinstrument.py
    then stops logging the loss it captures from ``backward()``)."""
    return _logs_own_loss


def _after_fork_in_child() -> None:
    global _writer_lock
    _writer_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def _from_env() -> _Writer | _Disabled:
    url, run_id = os.environ.get("TORCHYARD_RANK_REDIS_URL", ""), os.environ.get("TORCHYARD_RUN_ID", "")
    if not url or not run_id:
        warnings.warn(
            "torchyard.log: TORCHYARD_RANK_REDIS_URL or TORCHYARD_RUN_ID is not set; metrics are not recorded",
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
    if "loss" in scalars:
        global _logs_own_loss
        _logs_own_loss = True
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


def log_facts(facts: dict[str, Any]) -> None:
    """Records how this attempt runs (:class:`torchyard.facts.RunFacts` as JSON; rank 0, once per
    attempt): the platform keeps it on the attempt for the scaling advisor."""
    _get().send(streams.FACTS, {"facts": facts})


def flush(timeout: float = 30) -> bool:
    """Waits until every point logged so far is written to Redis; True if done within ``timeout``."""
    writer = _writer
    if writer is None or writer.pid != os.getpid():
        return True
    return writer.flush(timeout)
