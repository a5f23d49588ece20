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

import torch
from torch._C._distributed_c10d import ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
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


HOOK_SWITCH = "torch allreduce_hook (hook switch)"  # the part that replaces DDP's built-in all-reduce
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

    def wrap(self, fn: Callable[..., Any], name: str | None, signature: bool = True) -> Callable[..., Any]:
        """``fn`` accounted as instrumentation (``name``) or excluded (``None``). ``signature``: the
        wrapper takes ``fn``'s name and annotations (DDP inspects a hook's); without, it is made in
        a fraction of the time (wrappers made per call, inside counted code, are charged there)."""
        cell_of, clock = self._cell, self.clock

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

        return functools.wraps(fn)(accounted) if signature else accounted

    def counted(self, fn: Callable[..., Any], name: str, signature: bool = True) -> Callable[..., Any]:
        return self.wrap(fn, name, signature)

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
        return self._fut.then(self._acct.counted(callback, self._name, signature=False))

    def add_done_callback(self, callback: Callable[..., Any]) -> Any:
        return self._fut.add_done_callback(self._acct.counted(callback, self._name, signature=False))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fut, name)


def _wait(work: Any, *args: Any, **kwargs: Any) -> Any:
    return work.wait(*args, **kwargs)


class _WorkProxy:
    """A ``dist.Work`` whose ``wait()`` is torch's (excluded) and whose future callbacks are ours.
    Made per collective inside counted code, so it only stores: the excluded wait is made once."""

    __slots__ = ("_acct", "_wait", "_work")

    def __init__(self, acct: Accounting, work: Any, wait: Callable[..., Any]) -> None:
        self._acct, self._work, self._wait = acct, work, wait

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._wait(self._work, *args, **kwargs)

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
        self._engine.queue_callback(self._acct.counted(callback, "backward-end callback", signature=False))


@contextlib.contextmanager
def accounted_instrumentation(acct: Accounting) -> Iterator[None]:
    """Each place where control enters instrumentation code, wrapped (see the module docstring),
    and torch's own code nested inside it excluded; restored on exit. Only entry points are
    wrapped (nested instrumentation is inside them), so the accounting costs little.
    Strategies built inside are accounted."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from workers.runtime.strategies import ddp, fsdp, local_sgd, zero

    saved: list[tuple[Any, str, Any]] = []
    absent = object()

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, vars(owner).get(name, absent)))
        setattr(owner, name, value)

    def count(owner: Any, *names: str) -> None:
        for name in names:
            patch(owner, name, acct.counted(getattr(owner, name), f"{getattr(owner, '__name__', '')}.{name}"))

    count(
        CommTimer, "begin_step", "batch_ready", "data_ready", "expose_tail"
    )  # the loop's own; the backward-end callback's
    track = CommTimer.track

    def track_(self: CommTimer, kind: str, nbytes: int, start: Any, fut: Any) -> Any:
        return track(self, kind, nbytes, start, _FutureProxy(acct, fut, "comm done callback"))  # type: ignore[arg-type]

    patch(CommTimer, "track", track_)  # nested in a timed hook: only its callback is an entry point

    wait = acct.excluded(_wait)  # torch's wait() of every proxied work
    timed_work_init = comm._TimedWork.__init__

    def timed_work_init_(self: Any, timer: CommTimer, kind: str, nbytes: int, start: Any, work: Any) -> None:
        timed_work_init(self, timer, kind, nbytes, start, _WorkProxy(acct, work, wait))

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
            # torch's all-reduce hook stands where the bare build runs DDP's built-in C++ path: its
            # Python is the hook switch's cost (the division and the collective's launch in it,
            # which the built-in path runs too, are excluded below); other hooks run bare as well
            switch = hook is default_hooks.allreduce_hook
            inner = acct.counted(hook, HOOK_SWITCH) if switch else acct.excluded(hook)
            return acct.counted(timed(self, inner, nbytes), f"{cls.__name__} timed hook")

        patch(cls, "timed", timed_)
    patch(comm, "Variable", _EngineProxy(acct, comm.Variable))
    # in the hook switch, torch's work that the built-in path does as well (in C++): the bucket's
    # division by the world size and the collective's launch
    patch(torch.Tensor, "div_", acct.excluded(torch.Tensor.div_))
    patch(ProcessGroup, "allreduce", acct.excluded(ProcessGroup.allreduce))

    count(fsdp.TimedAllGather, "__call__")
    count(fsdp.TimedReduceScatter, "__call__")
    patch(_fsdp_collectives.DefaultAllGather, "__call__", acct.excluded(_fsdp_collectives.DefaultAllGather.__call__))
    patch(
        _fsdp_collectives.DefaultReduceScatter,
        "__call__",
        acct.excluded(_fsdp_collectives.DefaultReduceScatter.__call__),
    )
    fsdp_timed = fsdp._timed

    def fsdp_timed_(timer: CommTimer, kind: str, nbytes: int, start: Any, work: Any, group: Any) -> Any:
        fsdp_timed(timer, kind, nbytes, start, None if work is None else _WorkProxy(acct, work, wait), group)
        return work

    patch(fsdp, "_timed", fsdp_timed_)
    expose_waits = fsdp._expose_waits

    def expose_waits_(owner: Any, method: str, timer: CommTimer) -> None:  # CUDA: FSDP's waits, timed
        setattr(owner, method, acct.excluded(getattr(owner, method)))
        expose_waits(owner, method, timer)
        setattr(owner, method, acct.counted(getattr(owner, method), "FSDP timed wait"))

    patch(fsdp, "_expose_waits", expose_waits_)
    # ZeRO's parameter sync: our interval around torch's sync (the broadcasts and their waits)
    count(zero.TimedSync, "__call__")
    patch(ZeroRedundancyOptimizer, "_sync_params", acct.excluded(ZeroRedundancyOptimizer._sync_params))  # type: ignore[attr-defined]
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
