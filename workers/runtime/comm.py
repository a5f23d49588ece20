"""Where the time goes: one home for timing a strategy's collectives.

A :class:`CommTimer` collects, per training step, the intervals during which collectives were in
flight (start, end, bytes, kind) and the intervals during which the training step *waited* for
communication, then turns them into the step's figures (see README, "Metrics"):

- ``comm_time_s``: the length of the union of the collective intervals;
- ``exposed_comm_s``: the length of the union of the waited-for intervals;
- ``comm_bytes``, ``algbw_GBps`` = bytes / comm_time_s, ``busbw_GBps`` = Σ bytes × factor(kind) /
  comm_time_s (nccl-tests factors: all-reduce 2(n−1)/n; all-gather, reduce-scatter (n−1)/n;
  broadcast and send/recv 1).

On CPU a time is ``time.perf_counter()`` (wall clock around calls, or inside a future's ``then``
callback, which on Gloo runs when the work completes). On CUDA a time is a
``torch.cuda.Event(enable_timing=True)`` recorded on the current stream (inside a future's callback
the current stream is the collective's); a step's events are read one step later, so a step's
figures are ready at the end of the next step (:meth:`CommTimer.end_step` says which).

Strategies use the small helpers here: :meth:`CommTimer.track` (a future), :meth:`CommTimer.call`
(a blocking call), :class:`TimedDist` (a stand-in for the ``dist`` module global of a torch module
whose collectives we time) and :meth:`CommTimer.expose_tail` (DDP: exposed = comm end − backward
compute end).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

Mark = float | torch.cuda.Event

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, SEND_RECV = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "send_recv",
)


def bus_factor(kind: str, world: int) -> float:
    """nccl-tests' busbw / algbw factor for a collective over ``world`` ranks."""
    if world < 2:
        return 0.0
    if kind == ALL_REDUCE:
        return 2 * (world - 1) / world
    if kind in (ALL_GATHER, REDUCE_SCATTER):
        return (world - 1) / world
    return 1.0


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, -math.inf, -math.inf
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if start > cur_end:
            total += max(0.0, cur_end - cur_start) if cur_end > -math.inf else 0.0
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end > -math.inf:
        total += cur_end - cur_start
    return total


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(slots=True)
class _Step:
    step: int
    origin: Mark
    end: Mark | None = None  # end_step's mark
    comms: list[tuple[Mark, Mark, int, str]] = field(default_factory=list)
    exposed: list[tuple[Mark, Mark]] = field(default_factory=list)
    tail_from: Mark | None = None  # exposed also = [tail_from, last comm end] (DDP)
    extra_bytes: list[tuple[int, str]] = field(default_factory=list)  # bytes of collectives timed as a whole


def figures(
    comms: list[tuple[float, float, int, str]],
    exposed: list[tuple[float, float]],
    world: int,
    extra_bytes: list[tuple[int, str]] | None = None,
) -> dict[str, float]:
    """A step's communication figures from its intervals (any common time origin)."""
    # plain loops, no generators: this runs at every step of every rank
    nbytes, bus_bytes, count = 0, 0.0, 0
    spans = []
    for s, e, b, k in comms:
        spans.append((s, e))
        if b > 0:
            nbytes, bus_bytes, count = nbytes + b, bus_bytes + b * bus_factor(k, world), count + 1
    for b, k in extra_bytes or ():
        if b > 0:
            nbytes, bus_bytes, count = nbytes + b, bus_bytes + b * bus_factor(k, world), count + 1
    comm_time = union_length(spans) if spans else 0.0
    waited = union_length(exposed) if exposed else 0.0
    return {
        "comm_time_s": comm_time,
        "exposed_comm_s": min(waited, comm_time) if comm_time > 0 else waited,
        "comm_bytes": float(nbytes),
        "comm_ops": float(count),
        "algbw_GBps": nbytes / comm_time / 1e9 if comm_time > 0 else 0.0,
        "busbw_GBps": bus_bytes / comm_time / 1e9 if comm_time > 0 else 0.0,
    }


class CommTimer:
    """Per-step collective intervals for one rank; cheap enough to stay on (a clock read or a CUDA
    event per collective, a few list appends, a union over a handful of intervals per step)."""

    def __init__(self, world: int, device: torch.device, inject_delay_s: float = 0.0) -> None:
        self.world = world
        self.device = device
        self.cuda = device.type == "cuda"
        self._calibration: dict[int, float] = {}
        self._log_sizes: list[float] = []  # the calibration in log-log, for interpolation
        self._log_busbw: list[float] = []
        self.inject_delay_s = inject_delay_s  # tests: added to one collective on even steps
        self._step: _Step | None = None
        self._pending: list[_Step] = []  # CUDA: steps whose events are read a step later
        self.no_future: set[str] = set()  # kinds whose Work had no future (Gloo send/recv)
        self._lock = threading.Lock()
        # a mark: on CPU the clock itself (no Python frame per call: this runs several times a step)
        self.now: Callable[[], Mark] = self._event if self.cuda else time.perf_counter

    @property
    def calibration(self) -> dict[int, float]:
        """Message bytes -> achievable busbw (GB/s), measured at run start."""
        return self._calibration

    @calibration.setter
    def calibration(self, measured: dict[int, float]) -> None:
        self._calibration = {size: measured[size] for size in sorted(measured)}
        usable = [size for size in self._calibration if measured[size] > 0]
        self._log_sizes = [math.log(size) for size in usable]
        self._log_busbw = [math.log(measured[size]) for size in usable]

    def reference_busbw(self, nbytes: float) -> float:
        """The calibrated busbw (GB/s) for messages of ``nbytes``: interpolated in log-log between
        the calibrated sizes (busbw grows from latency-bound to bandwidth-bound in between), the
        end values beyond them; 0 without a calibration."""
        xs, ys = self._log_sizes, self._log_busbw
        if not xs:
            return 0.0
        x = math.log(max(nbytes, 1.0))
        i = bisect.bisect(xs, x)
        if i == 0 or i == len(xs):
            return math.exp(ys[0] if i == 0 else ys[-1])
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(ys[i - 1] + t * (ys[i] - ys[i - 1]))

    # -- marks ---------------------------------------------------------------------------------

    def _event(self) -> Mark:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, origin: Mark, mark: Mark) -> float:
        if isinstance(mark, float):
            assert isinstance(origin, float)
            return mark - origin
        assert isinstance(origin, torch.cuda.Event)
        if not mark.query():
            mark.synchronize()  # a step old: normally long done; never a device-wide sync
        return origin.elapsed_time(mark) / 1e3

    # -- recording -----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step.step if self._step else 0

    def begin_step(self, step: int) -> None:
        """The step starts now: its time runs from this mark to :meth:`end_step`'s."""
        self._step = _Step(step, self.now())

    def add(self, kind: str, nbytes: int, start: Mark, end: Mark) -> None:
        if self._step is not None:
            with self._lock:
                self._step.comms.append((start, end, nbytes, kind))

    def add_bytes(self, kind: str, *sizes: int) -> None:
        """Bytes of collectives whose time is already covered by an enclosing interval."""
        if self._step is not None:
            with self._lock:
                self._step.extra_bytes.extend((nbytes, kind) for nbytes in sizes)

    def add_exposed(self, start: Mark, end: Mark) -> None:
        if self._step is not None:
            with self._lock:
                self._step.exposed.append((start, end))

    def expose_tail(self, compute_end: Mark) -> None:
        """DDP: the step waited from ``compute_end`` (backward compute done) to the last comm end."""
        if self._step is not None:
            self._step.tail_from = compute_end

    def should_inject(self, step: int) -> bool:
        return self.inject_delay_s > 0 and step % 2 == 0

    def track(
        self, kind: str, nbytes: int, start: Mark, fut: torch.futures.Future[Any], inject: bool = False
    ) -> torch.futures.Future[Any]:
        """Time ``fut`` from ``start`` until it completes; returns the future to hand on."""
        if inject and self.inject_delay_s > 0 and self.should_inject(self.step):
            fut = _delayed(fut, self.inject_delay_s)
        step = self._step

        def done(f: torch.futures.Future[Any]) -> Any:
            end = self.now()
            if step is not None:
                with self._lock:
                    step.comms.append((start, end, nbytes, kind))
            return f.value()

        return fut.then(done)

    def call(self, kind: str, nbytes: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A blocking collective: in flight and waited for during the whole call."""
        start = self.now()
        result = fn(*args, **kwargs)
        end = self.now()
        self.add(kind, nbytes, start, end)
        self.add_exposed(start, end)
        return result

    def work(self, kind: str, nbytes: int, start: Mark, work: Any) -> Any:
        """An async collective's Work: timed until done (its future where the backend has one,
        else until ``wait()`` returns); ``wait()`` on the training thread counts as exposed."""
        return _TimedWork(self, kind, nbytes, start, work)

    # -- figures -------------------------------------------------------------------------------

    def end_step(self, keep: bool = True) -> list[tuple[int, dict[str, float]]]:
        """Close the current step (its end mark: now); return (step, figures) for the steps now
        readable: this one on CPU, the previous one on CUDA. ``keep=False``: nobody wants this
        step's figures (not a logged step): it is dropped unread."""
        current, self._step = self._step, None
        if current is None:
            return []
        if keep:
            current.end = self.now()
            if not self.cuda:
                return [(current.step, self._figures(current))]
        ready, self._pending = self._pending, [current] if keep else []
        return [(s.step, self._figures(s)) for s in ready]

    def flush(self) -> list[tuple[int, dict[str, float]]]:
        ready, self._pending = self._pending, []
        return [(s.step, self._figures(s)) for s in ready]

    def _figures(self, s: _Step) -> dict[str, float]:
        with self._lock:
            comms, exposed, extra = list(s.comms), list(s.exposed), list(s.extra_bytes)
        tail_from = s.tail_from
        if not isinstance(s.origin, float):  # CUDA events: seconds since the step began
            origin, seconds = s.origin, self._seconds
            comms = [(seconds(origin, a), seconds(origin, b), n, k) for a, b, n, k in comms]
            exposed = [(seconds(origin, a), seconds(origin, b)) for a, b in exposed]
            tail_from = None if tail_from is None else seconds(origin, tail_from)
        # CPU: perf_counter readings as they are (unions and differences need no common zero)
        if tail_from is not None and comms:
            exposed.append((tail_from, max(e for _, e, _, _ in comms)))  # type: ignore[type-var]
        out = figures(comms, exposed, self.world, extra)  # type: ignore[arg-type]
        out["busbw_efficiency"] = self.efficiency(out)
        out["step_time_s"] = 0.0 if s.end is None else self._seconds(s.origin, s.end)
        return out

    def efficiency(self, fig: dict[str, float]) -> float:
        """Achieved busbw / the calibrated busbw at the step's mean message size."""
        if not self._log_sizes or fig["comm_ops"] <= 0 or fig["busbw_GBps"] <= 0:
            return 0.0
        return fig["busbw_GBps"] / self.reference_busbw(fig["comm_bytes"] / fig["comm_ops"])


def _delayed(fut: torch.futures.Future[Any], delay: float) -> torch.futures.Future[Any]:
    """``fut``'s result, ``delay`` seconds after it completes; the wait happens on a timer thread,
    never inline in the thread that attached it (a done future runs callbacks inline)."""
    out: torch.futures.Future[Any] = torch.futures.Future()

    def later(f: torch.futures.Future[Any]) -> None:
        threading.Timer(delay, lambda: out.set_result(f.value())).start()

    fut.add_done_callback(later)
    return out


class _TimedWork:
    """Delegates to a ``dist.Work``; records its interval, and ``wait()`` on the main thread as exposed."""

    def __init__(self, timer: CommTimer, kind: str, nbytes: int, start: Mark, work: Any) -> None:
        self._timer, self._kind, self._nbytes, self._start, self._work = timer, kind, nbytes, start, work
        self._recorded = False
        # completion: on Gloo the callback runs when the work is done; on CUDA in stream order.
        # Some ops have no future on some backends (Gloo send/recv): then wait() ends the interval.
        # Asking costs a C++ exception with its backtrace (~0.1–1 ms), so a kind that had none once
        # is not asked again.
        if kind not in timer.no_future:
            try:  # a callback, not then(): no chained future to make and complete
                work.get_future().add_done_callback(self._done)
            except Exception:
                timer.no_future.add(kind)

    def _done(self, fut: torch.futures.Future[Any]) -> None:
        if not self._recorded:
            self._recorded = True
            self._timer.add(self._kind, self._nbytes, self._start, self._timer.now())

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        begin = self._timer.now()
        result = self._work.wait(*args, **kwargs)
        end = self._timer.now()
        if threading.get_ident() == threading.main_thread().ident:
            self._timer.add_exposed(begin, end)
        if not self._recorded:
            self._recorded = True
            self._timer.add(self._kind, self._nbytes, self._start, end)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class TimedDist:
    """A stand-in for ``torch.distributed`` as a module global of one torch module (installed with
    :func:`patch_dist`): its collectives are timed, everything else is torch.distributed itself.
    ``bytes_only``: the caller already times an enclosing interval; count bytes only."""

    def __init__(self, timer: CommTimer, bytes_only: bool = False) -> None:
        # torch.distributed's names as plain attributes (a lookup, not a Python frame each time
        # the torch module reads dist.get_world_size and the like), but for the timed ones
        timed = {name for name in vars(TimedDist) if not name.startswith("_")}
        self.__dict__.update({k: v for k, v in vars(dist).items() if not k.startswith("__") and k not in timed})
        self._timer, self._bytes_only = timer, bytes_only

    def __getattr__(self, name: str) -> Any:  # whatever torch.distributed gained since
        return getattr(dist, name)

    def _run(self, kind: str, nbytes: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._bytes_only:
            self._timer.add_bytes(kind, nbytes)
            return fn(*args, **kwargs)
        if kwargs.get("async_op"):
            start = self._timer.now()
            return self._timer.work(kind, nbytes, start, fn(*args, **kwargs))
        return self._timer.call(kind, nbytes, fn, *args, **kwargs)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._run(ALL_REDUCE, tensor_bytes(tensor), dist.all_reduce, tensor, *args, **kwargs)

    def broadcast(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._run(BROADCAST, tensor_bytes(tensor), dist.broadcast, tensor, *args, **kwargs)


def patch_dist(module: Any, timer: CommTimer, bytes_only: bool = False) -> Callable[[], None]:
    """Give ``module`` a timed ``dist``; returns the undo."""
    original = module.dist
    module.dist = TimedDist(timer, bytes_only)

    def undo() -> None:
        module.dist = original

    return undo
