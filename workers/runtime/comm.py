"""Where the time goes: one home for timing a strategy's collectives.

A :class:`CommTimer` collects, per training step, the intervals during which collectives were in
flight (start, end, bytes, kind) and the intervals during which the training step *waited* for
communication, then turns them into the step's figures (see README, "Metrics"):

- ``comm_time_s``: the length of the union of the collective intervals;
- ``exposed_comm_s``: the length of the union of the waited-for intervals;
- ``comm_bytes``, ``algbw_GBps`` = bytes / comm_time_s, ``busbw_GBps`` = Σ bytes × factor(kind) /
  comm_time_s (nccl-tests factors: all-reduce 2(n−1)/n; all-gather, reduce-scatter (n−1)/n;
  broadcast and send/recv 1);
- ``first_comm_at_s``: when the step's first collective was launched, from the step's start (the
  rank's arrival at it; 0 for a step without collectives).

On CPU a time is ``time.perf_counter()`` (wall clock around calls, or inside a future's ``then``
callback, which on Gloo runs when the work completes). On CUDA a time is a
``torch.cuda.Event(enable_timing=True)`` recorded on the current stream (inside a future's callback
the current stream is the collective's); a step's events are read one step later, so a step's
figures are ready at the end of the next step (:meth:`CommTimer.end_step` says which).

Also the one home for unions of intervals (``merged``, ``uncovered``), which the sampled steps'
trace figures (``profiling.py``) use too. Strategies use the small helpers here: :meth:`CommTimer.track` (a future), :meth:`CommTimer.call`
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
from torch.autograd import Variable

from torchyard.collectives import KIND_BYTES, Collective, bus_factor

Mark = float | torch.cuda.Event

# The kinds' names and bus factors live in the contract (the scaling advisor uses them too).
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
BROADCAST, SEND_RECV, ALL_TO_ALL = Collective.BROADCAST, Collective.SEND_RECV, Collective.ALL_TO_ALL


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of the intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def uncovered(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """How much of the disjoint sorted intervals ``a`` no interval of ``b`` (disjoint, sorted) covers."""
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        total += max(0.0, end - cursor)
    return total


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    return length(merged(intervals))


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(slots=True)
class _Step:
    step: int
    origin: Mark
    end: Mark | None = None  # end_step's mark
    batch_ready: Mark | None = None  # the batch is in host memory: data_wait_s runs from origin to here
    data_ready: Mark | None = None  # the batch is on the device: data_time_s runs from origin to here
    # (start, end, bytes, kind, ranks): ranks, the collective's group size (0: the whole world)
    comms: list[tuple[Mark, Mark, int, str, int]] = field(default_factory=list)
    exposed: list[tuple[Mark, Mark]] = field(default_factory=list)
    tail_from: Mark | None = None  # exposed also = [tail_from, last comm end] (DDP)
    # (bytes, kind, ranks) of collectives timed as a whole
    extra_bytes: list[tuple[int, str, int]] = field(default_factory=list)


def figures(
    comms: list[tuple[float, float, int, str, int]],
    exposed: list[tuple[float, float]],
    world: int,
    extra_bytes: list[tuple[int, str, int]] | None = None,
) -> dict[str, float]:
    """A step's communication figures from its intervals (any common time origin). A collective's
    ``ranks`` is its group's size (0: ``world``): a 2-D mesh's collectives run on sub-groups, and
    the bus factor is the group's. ``comm_bytes_<kind>``: the bytes of each kind the step issued."""
    # plain loops, no generators: this runs at every step of every rank
    nbytes, bus_bytes, count = 0, 0.0, 0
    spans = []
    by_kind: dict[str, float] = {}
    for s, e, b, k, n in comms:
        spans.append((s, e))
        if b > 0:
            nbytes, bus_bytes, count = nbytes + b, bus_bytes + b * bus_factor(k, n or world), count + 1
            by_kind[k] = by_kind.get(k, 0.0) + b
    for b, k, n in extra_bytes or ():
        if b > 0:
            nbytes, bus_bytes, count = nbytes + b, bus_bytes + b * bus_factor(k, n or world), count + 1
            by_kind[k] = by_kind.get(k, 0.0) + b
    comm_time = union_length(spans) if spans else 0.0
    waited = union_length(exposed) if exposed else 0.0
    out: dict[str, float] = {
        "comm_time_s": comm_time,
        "exposed_comm_s": min(waited, comm_time) if comm_time > 0 else waited,
        "comm_bytes": float(nbytes),
        "comm_ops": float(count),
        "algbw_GBps": nbytes / comm_time / 1e9 if comm_time > 0 else 0.0,
        "busbw_GBps": bus_bytes / comm_time / 1e9 if comm_time > 0 else 0.0,
    }
    for kind, kind_bytes in by_kind.items():
        out[KIND_BYTES + kind] = kind_bytes
    return out


class CommTimer:
    """Per-step collective intervals for one rank; cheap enough to stay on (a clock read or a CUDA
    event per collective, a few list appends, a union over a handful of intervals per step)."""

    def __init__(self, world: int, device: torch.device) -> None:
        self.world = world
        self.device = device
        self.cuda = device.type == "cuda"
        self._calibration: dict[int, float] = {}
        self._log_sizes: list[float] = []  # the calibration in log-log, for interpolation
        self._log_busbw: list[float] = []
        self._step: _Step | None = None
        self._pending: list[_Step] = []  # CUDA: steps whose events are read a step later
        self.no_future: set[str] = set()  # kinds whose Work had no future (Gloo send/recv)
        self._kinds: set[str] = set()  # the collective kinds issued so far: comm_bytes_<kind> from then on
        # (step, kind -> collectives) of the newest step worked out: how many a step issues, which the
        # run's facts carry once (the scaling advisor's latency term), never a metric of every step
        self.ops: tuple[int, dict[str, int]] = (0, {})
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
        if self.device.index is None or torch.cuda.current_device() == self.device.index:
            event.record()  # the current stream: inside a collective's callback, the collective's
        else:  # a script that never called set_device: its work runs on the model's device, not device 0
            event.record(torch.cuda.current_stream(self.device))
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

    def batch_ready(self) -> None:
        """The step's batch is in host memory (optional, before :meth:`data_ready`): splits
        ``data_time_s`` into ``data_wait_s`` (waiting for the loader) and ``data_copy_s`` (the
        host→device copy after it), two parts of one clock that add up to it exactly."""
        if self._step is not None:
            self._step.batch_ready = self.now()

    def data_ready(self) -> None:
        """The step's batch is loaded (and its copy to the device queued): ``data_time_s`` is the time
        from the step's start to here on the step's own clock (CUDA: events, so it is subtracted
        from an event-timed step in like units; the device's view: the wait it saw)."""
        if self._step is not None:
            self._step.data_ready = self.now()

    def add(self, kind: str, nbytes: int, start: Mark, end: Mark, ranks: int = 0) -> None:
        """A collective in flight from ``start`` to ``end`` on a group of ``ranks`` (0: the world)."""
        if self._step is not None:
            with self._lock:
                self._step.comms.append((start, end, nbytes, kind, ranks))

    def add_bytes(self, kind: str, *sizes: int, ranks: int = 0) -> None:
        """Bytes of collectives whose time is already covered by an enclosing interval."""
        if self._step is not None:
            with self._lock:
                self._step.extra_bytes.extend((nbytes, kind, ranks) for nbytes in sizes)

    def add_exposed(self, start: Mark, end: Mark) -> None:
        if self._step is not None:
            with self._lock:
                self._step.exposed.append((start, end))

    def expose_tail(self, compute_end: Mark) -> None:
        """DDP: the step waited from ``compute_end`` (backward compute done) to the last comm end."""
        if self._step is not None:
            self._step.tail_from = compute_end

    def begin_bucket(self, bucket: Any) -> tuple[Mark, bool]:
        """A DDP comm hook's first act (ours and an unmodified script's alike): the bucket's start
        mark, and whether it is the last bucket; the last one marks the end of backward compute when
        the autograd engine runs its final callbacks (as DDP's own timer does)."""
        start, last = self.now(), bucket.is_last()
        if last:
            Variable._execution_engine.queue_callback(lambda: self.expose_tail(self.now()))
        return start, last

    def track(self, kind: str, nbytes: int, start: Mark, fut: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
        """Time ``fut`` from ``start`` until it completes; returns the future to hand on."""
        step = self._step

        def done(f: torch.futures.Future[Any]) -> Any:
            end = self.now()
            if step is not None:
                with self._lock:
                    step.comms.append((start, end, nbytes, kind, 0))
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

    def blocking(self, kind: str, nbytes: int, start: Mark, ranks: int = 0) -> None:
        """A collective the step waited for from ``start`` until now (in flight and exposed)."""
        end = self.now()
        self.add(kind, nbytes, start, end, ranks)
        self.add_exposed(start, end)

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
        zero = s.origin  # CPU: perf_counter readings as they are (unions and differences need no common zero)
        if not isinstance(s.origin, float):  # CUDA events: seconds since the step began
            origin, seconds, zero = s.origin, self._seconds, 0.0
            comms = [(seconds(origin, a), seconds(origin, b), n, k, r) for a, b, n, k, r in comms]
            exposed = [(seconds(origin, a), seconds(origin, b)) for a, b in exposed]
            tail_from = None if tail_from is None else seconds(origin, tail_from)
        if tail_from is not None and comms:
            exposed.append((tail_from, max(e for _, e, _, _, _ in comms)))  # type: ignore[type-var]
        out = figures(comms, exposed, self.world, extra)  # type: ignore[arg-type]
        ops: dict[str, int] = {}
        for _, _, nbytes, kind, _ in comms:
            if nbytes > 0:  # as comm_ops counts them
                ops[kind] = ops.get(kind, 0) + 1
        for nbytes, kind, _ in extra:
            if nbytes > 0:
                ops[kind] = ops.get(kind, 0) + 1
        self.ops = (s.step, ops)
        for kind in self._kinds:  # a kind once issued is reported at every later step (0 when idle)
            out.setdefault(KIND_BYTES + kind, 0.0)
        self._kinds.update(key[len(KIND_BYTES) :] for key in out if key.startswith(KIND_BYTES))
        out["busbw_efficiency"] = self.efficiency(out)
        # When this rank reached the step's first collective, from its step's start: steps start
        # together (each begins as the last one's collectives release every rank), so a rank
        # that arrives later than the others is the one they wait for (backend/stragglers.py).
        out["first_comm_at_s"] = min(c[0] for c in comms) - zero if comms else 0.0  # type: ignore[operator, type-var]
        out["step_time_s"] = 0.0 if s.end is None else self._seconds(s.origin, s.end)
        if s.data_ready is not None:
            out["data_time_s"] = self._seconds(s.origin, s.data_ready)
            if s.batch_ready is not None:
                out["data_wait_s"] = self._seconds(s.origin, s.batch_ready)
                out["data_copy_s"] = out["data_time_s"] - out["data_wait_s"]
        return out

    def efficiency(self, fig: dict[str, float]) -> float:
        """Achieved busbw / the calibrated busbw at the step's mean message size."""
        if not self._log_sizes or fig["comm_ops"] <= 0 or fig["busbw_GBps"] <= 0:
            return 0.0
        return fig["busbw_GBps"] / self.reference_busbw(fig["comm_bytes"] / fig["comm_ops"])


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


# torch.distributed._functional_collectives: the functions that issue a c10d functional op (the
# deprecated *_tensor aliases call these through the module, so they are counted once), with
# (kind, bytes of a call: nccl-tests' convention, from (input tensor, group size), where the group
# argument is: its position after the input tensor)
_FUNCTIONAL: dict[str, tuple[str, Callable[[torch.Tensor, int], int], int]] = {
    "all_reduce": (ALL_REDUCE, lambda t, n: tensor_bytes(t), 1),
    "all_gather_single": (ALL_GATHER, lambda t, n: tensor_bytes(t) * n, 1),  # the whole gathered buffer
    "reduce_scatter_single": (REDUCE_SCATTER, lambda t, n: tensor_bytes(t), 2),  # the whole input
    "all_to_all_single": (ALL_TO_ALL, lambda t, n: tensor_bytes(t), 2),
    "broadcast": (BROADCAST, lambda t, n: tensor_bytes(t), 1),
}


def patch_functional_collectives(timing: Callable[[], CommTimer | None]) -> Callable[[], None]:
    """Time the collectives of torch's functional-collective layer, which DTensor (tensor
    parallelism, its redistributions, loss parallel) issues instead of ``torch.distributed.*``:
    each goes straight to a ``_c10d_functional`` C++ op, so no stand-in for ``dist`` sees it.

    A functional collective returns at once with an ``AsyncCollectiveTensor`` that waits at its
    first use, and in eager DTensor the next op uses it right away. So the stand-in waits for it
    here: the interval from the call to the wait's return is the collective, all of it exposed
    (CPU: the call and the blocking wait; CUDA: events on the current stream before the launch and
    after the stream's wait for the collective). ``timing()``: the timer, when a call now is to be
    timed (a step is being measured), else None. Under ``torch.compile`` tracing the original runs
    (the compiled graph schedules its own waits). Returns the undo."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    originals = {name: getattr(funcol, name) for name in _FUNCTIONAL}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        kind, nbytes, group_at = _FUNCTIONAL[name]

        def collective(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            timer = None if torch.compiler.is_compiling() else timing()
            if timer is None:
                return fn(tensor, *args, **kwargs)
            group = args[group_at] if len(args) > group_at else kwargs["group"]
            ranks = c10d._get_group_size_by_name(funcol._resolve_group_name(group))
            start = timer.now()
            out = fn(tensor, *args, **kwargs)
            if isinstance(out, funcol.AsyncCollectiveTensor):
                out = out.wait()
            timer.blocking(kind, nbytes(tensor, ranks), start, ranks)
            return out

        collective.__wrapped__ = fn  # type: ignore[attr-defined]
        return collective

    for name, fn in originals.items():
        setattr(funcol, name, timed(name, fn))

    def undo() -> None:
        for name, fn in originals.items():
            setattr(funcol, name, fn)

    return undo
