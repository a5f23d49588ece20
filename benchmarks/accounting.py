"""Direct accounting of instrumentation time, for ``benchmarks/overhead.py``: every place where
control enters instrumentation code is wrapped, torch's own code nested inside is excluded, and
each thread's exclusive time in instrumentation is summed (its CPU time by default)."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.pipelining import schedules as schedules_module

from torchyard import sdk
from workers.runtime import comm
from workers.runtime.comm import CommTimer


class _Cell:
    """One thread's accounting: a stack of frames (a name: instrumentation; None: excluded)."""

    __slots__ = ("by", "calls", "cpu_ns", "last", "main", "ns", "stack")

    def __init__(self) -> None:
        self.stack: list[str | None] = []
        self.last = 0
        self.ns = 0
        self.cpu_ns = 0
        self.calls = 0
        self.by: dict[str, int] = {}
        self.main = threading.current_thread() is threading.main_thread()


CLOCKS: dict[str, Callable[[], int]] = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}


class Accounting:
    """Exclusive time inside instrumentation code, per thread: at each entry/exit of a wrapped
    function the time since the last transition goes to the frame on top of the thread's stack,
    if that frame is instrumentation. Torch calls nested inside (``excluded``) are not charged.
    The clock: the thread's CPU time (the work the instrumentation adds), or wall time (which also
    charges it for being preempted, e.g. by the Gloo threads of the collective it just launched,
    when ranks share too few cores: an upper bound)."""

    def __init__(self, clock: Callable[[], int] = time.thread_time_ns) -> None:
        self.clock = clock
        self._local = threading.local()
        self._cells: list[_Cell] = []
        self._lock = threading.Lock()

    def _cell(self) -> _Cell:
        cell: _Cell | None = getattr(self._local, "cell", None)
        if cell is None:
            cell = self._local.cell = _Cell()
            with self._lock:
                self._cells.append(cell)
        return cell

    def reset(self) -> None:
        for cell in self._cells:
            cell.ns = cell.cpu_ns = cell.calls = 0
            cell.by.clear()

    def totals(self) -> dict[str, float]:
        out = {"main": 0.0, "other": 0.0, "writer": 0.0, "calls": 0.0}
        for cell in self._cells:
            out["main" if cell.main else "other"] += cell.ns
            out["writer"] += cell.cpu_ns
            out["calls"] += cell.calls
        return out

    def ns(self) -> int:
        return sum(cell.ns for cell in self._cells)

    def by_name(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for cell in self._cells:
            for name, ns in cell.by.items():
                out[name] = out.get(name, 0) + ns
        return out

    def wrap(self, fn: Callable[..., Any], name: str | None) -> Callable[..., Any]:
        """``fn`` accounted as instrumentation (``name``) or excluded (``None``)."""
        cell_of, clock = self._cell, self.clock

        @functools.wraps(fn)
        def accounted(*args: Any, **kwargs: Any) -> Any:
            cell = cell_of()
            now = clock()
            if cell.stack and (top := cell.stack[-1]) is not None:
                cell.ns += now - cell.last
                cell.by[top] = cell.by.get(top, 0) + now - cell.last
            cell.stack.append(name)
            cell.calls += 1
            cell.last = now
            try:
                return fn(*args, **kwargs)
            finally:
                now = clock()
                if (popped := cell.stack.pop()) is not None:
                    cell.ns += now - cell.last
                    cell.by[popped] = cell.by.get(popped, 0) + now - cell.last
                cell.last = now

        return accounted

    def counted(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        return self.wrap(fn, name)

    def excluded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.wrap(fn, None)

    def cpu(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The calling thread's CPU time in ``fn`` (the SDK writer: its wall time is mostly Redis's)."""

        @functools.wraps(fn)
        def accounted(*args: Any, **kwargs: Any) -> Any:
            cell, start = self._cell(), time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                cell.cpu_ns += time.thread_time_ns() - start

        return accounted


class _FutureProxy:
    """A future whose callbacks are accounted as instrumentation."""

    def __init__(self, acct: Accounting, fut: Any, name: str) -> None:
        self._acct, self._fut, self._name = acct, fut, name

    def then(self, callback: Callable[..., Any]) -> Any:
        return self._fut.then(self._acct.counted(callback, self._name))

    def add_done_callback(self, callback: Callable[..., Any]) -> Any:
        return self._fut.add_done_callback(self._acct.counted(callback, self._name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fut, name)


class _WorkProxy:
    """A ``dist.Work`` whose ``wait()`` is torch's (excluded) and whose future callbacks are ours."""

    def __init__(self, acct: Accounting, work: Any) -> None:
        self._acct, self._work = acct, work
        self.wait = acct.excluded(work.wait)  # made once: making it in wait() would be charged there

    def get_future(self) -> Any:
        return _FutureProxy(self._acct, self._work.get_future(), "work callback")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _EngineProxy:
    """Stands in for ``Variable`` in the DDP strategy module: final callbacks queued by the timed
    hook (the end of backward compute) are accounted."""

    def __init__(self, acct: Accounting, variable: Any) -> None:
        self._acct, self._engine = acct, variable._execution_engine

    @property
    def _execution_engine(self) -> Any:
        return self

    def queue_callback(self, callback: Callable[[], None]) -> None:
        self._engine.queue_callback(self._acct.counted(callback, "backward-end callback"))


@contextlib.contextmanager
def accounted_instrumentation(acct: Accounting) -> Iterator[None]:
    """Each place where control enters instrumentation code, wrapped (see the module docstring),
    and torch's own code nested inside it excluded; restored on exit. Only entry points are
    wrapped (nested instrumentation is inside them), so the accounting costs little.
    Strategies built inside are accounted."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from workers.runtime.strategies import ddp, fsdp, local_sgd

    saved: list[tuple[Any, str, Any]] = []
    absent = object()

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, vars(owner).get(name, absent)))
        setattr(owner, name, value)

    def count(owner: Any, *names: str) -> None:
        for name in names:
            patch(owner, name, acct.counted(getattr(owner, name), f"{getattr(owner, '__name__', '')}.{name}"))

    count(CommTimer, "begin_step", "expose_tail")  # the loop's own; the backward-end callback's
    track = CommTimer.track

    def track_(self: CommTimer, kind: str, nbytes: int, start: Any, fut: Any, inject: bool = False) -> Any:
        return track(self, kind, nbytes, start, _FutureProxy(acct, fut, "comm done callback"), inject)  # type: ignore[arg-type]

    patch(CommTimer, "track", track_)  # nested in a timed hook: only its callback is an entry point

    timed_work_init = comm._TimedWork.__init__

    def timed_work_init_(self: Any, timer: CommTimer, kind: str, nbytes: int, start: Any, work: Any) -> None:
        timed_work_init(self, timer, kind, nbytes, start, _WorkProxy(acct, work))

    patch(comm._TimedWork, "__init__", timed_work_init_)
    count(comm._TimedWork, "wait", "__getattr__")

    run = comm.TimedDist._run

    def run_(self: Any, kind: str, nbytes: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return run(self, kind, nbytes, acct.excluded(fn), *args, **kwargs)

    patch(comm.TimedDist, "_run", run_)
    count(comm.TimedDist, "__getattr__", "all_reduce", "broadcast")

    for cls in (ddp.DdpStrategy, local_sgd.LocalSgdStrategy):
        timed = cls.__dict__["timed"]

        def timed_(self: Any, hook: Any, nbytes: Any, timed: Any = timed, cls: Any = cls) -> Any:
            return acct.counted(timed(self, acct.excluded(hook), nbytes), f"{cls.__name__} timed hook")

        patch(cls, "timed", timed_)
    patch(ddp, "Variable", _EngineProxy(acct, ddp.Variable))

    count(fsdp.TimedAllGather, "__call__")
    count(fsdp.TimedReduceScatter, "__call__")
    patch(_fsdp_collectives.DefaultAllGather, "__call__", acct.excluded(_fsdp_collectives.DefaultAllGather.__call__))
    patch(
        _fsdp_collectives.DefaultReduceScatter,
        "__call__",
        acct.excluded(_fsdp_collectives.DefaultReduceScatter.__call__),
    )
    fsdp_timed = fsdp._timed

    def fsdp_timed_(timer: CommTimer, kind: str, nbytes: int, start: Any, work: Any) -> Any:
        fsdp_timed(timer, kind, nbytes, start, None if work is None else _WorkProxy(acct, work))
        return work

    patch(fsdp, "_timed", fsdp_timed_)
    # the pipeline wraps whatever _batch_p2p is when it is built (torch's, excluded); the timed
    # wrapper it installs is counted in measure()
    patch(schedules_module, "_batch_p2p", acct.excluded(schedules_module._batch_p2p))
    patch(sdk._Writer, "_send_batch", acct.cpu(sdk._Writer._send_batch))
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is absent:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
