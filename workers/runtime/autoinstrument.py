"""Step time, throughput and DDP communication of a user's script that does not change a line.

Installed at start-up in every rank of a script run (``workers/inject/sitecustomize.py``); it waits
for ``import torch`` (an import hook, so torch is never imported early) and then:

- **step boundaries**: a global optimizer step post-hook (``register_optimizer_step_post_hook``);
  step N runs from the end of step N−1's ``optimizer.step()`` to the end of its own (step 1 from
  the script's first module forward). With several optimizers, the first one to step counts.
- **communication**: DDP is wrapped so that, at its first forward, it registers torch's
  all-reduce comm hook timed by :class:`workers.runtime.comm.CommTimer` (the same timer and
  figures as the built-in workloads: ``comm_time_s``, ``exposed_comm_s``, ``comm_bytes``,
  ``algbw_GBps``, ``busbw_GBps``). A hook the script registers itself is timed instead of ours
  (bytes: the bucket's buffer; DDP's built-in C++ hooks are left untimed). The collectives the
  script calls itself through ``torch.distributed`` (``all_reduce``, ``all_gather[_into_tensor]``,
  ``reduce_scatter[_tensor]``, ``broadcast``, ``reduce``, ``all_to_all[_single]``, ``send``/``recv``,
  ``batch_isend_irecv``, and the ``all_gather_single``/``reduce_scatter_single`` that FSDP2's
  ``fully_shard`` issues), and DTensor's (tensor parallelism: ``torch.distributed._functional_collectives``,
  patched once imported, see ``comm.patch_functional_collectives``) are timed by the same timer: a blocking call is in flight and waited for
  during the whole call; an ``async_op=True`` one until its work completes (its future's callback;
  on CUDA an event recorded there, on the collective's stream; without a future, when ``wait()``
  returns), and the time the training thread spends in its ``wait()`` is exposed. Bytes follow
  nccl-tests (the whole gathered buffer, the whole reduce-scatter input). torch's own
  ``allreduce_hook``/``fp16_compress_hook``/PowerSGD call ``dist.all_reduce`` from inside DDP's hook:
  there the hook's interval already covers the call, so only its bytes count (the bucket's bytes
  then do not: no double counting). ``isend``/``irecv`` stay unwrapped (``P2POp`` checks them by
  identity); gather/scatter and the object collectives are not counted.
- **throughput**: the samples of each step's training-mode forwards of the DDP module (the first
  tensor argument's first dimension) give ``samples_per_s``; without DDP, ``steps_per_s``.
- **loss**: the mean of the one-element tensors ``backward()`` was called on in the step (the
  unscaled loss when it went through ``GradScaler.scale``), read with the step's other figures
  (no sync on CUDA). Once the script logs its own ``loss`` through ``torchyard.log`` this stops
  (a first step logged both ways keeps the value that came first: ours). A script whose gradient
  accumulation divides each micro-batch's loss should log its own.

Per rank and step it logs through the SDK: ``step_time_s``, ``samples_per_s`` or ``steps_per_s``,
``loss``, ``max_rss_bytes``, and with DDP the comm figures, ``compute_time_s`` and ``comm_fraction``. On CUDA
the step's begin and end marks are CUDA events read a step later (``steplog.StepLog``): the script's
steps are never synchronized by us.

Any failure in here is printed once; the rank then goes on uninstrumented.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import os
import sys
import threading
import traceback
import weakref
from typing import Any

_RUNTIME = os.path.dirname(os.path.abspath(__file__))


class _State:
    def __init__(self) -> None:
        self.disabled = False
        self.torch: Any = None
        self.comm: Any = None  # workers/runtime/comm.py, loaded by path
        self.steplog: Any = None  # workers/runtime/steplog.py, loaded by path
        self.timer: Any = None
        self.device: Any = None
        self.step = 0  # the step being measured; 0 before the first forward
        self.samples = 0
        self.primary: weakref.ref[Any] | None = None
        self.comm_timed = False
        self.steps: Any = None  # steplog.StepLog: a step's scalars wait there for its comm figures
        self.first_forward: Any = None
        self.loss_sum: Any = None  # the step's backward() losses, summed on their device (no sync)
        self.loss_count = 0
        self.exit_flush = False
        self.register_original: Any = None  # DDP.register_comm_hook before our patch
        self.local = threading.local()  # hook_depth: inside a timed DDP hook; hook_comm: it issued dist.*


_state = _State()


def _fail(where: str) -> None:
    if not _state.disabled:
        _state.disabled = True
        sys.stderr.write(
            f"torchyard: instrumentation failed in {where} and is off for this rank; training goes on\n"
            + traceback.format_exc()
        )
        sys.stderr.flush()


FUNCTIONAL_COLLECTIVES = "torch.distributed._functional_collectives"  # DTensor's (tensor parallelism)


def install() -> None:
    _load("hangdump").start()  # answers the platform's "why is it stuck" (needs no torch until asked)
    _after_import("torch", _on_torch)


def _after_import(name: str, patch: Any) -> None:
    """``patch(module)`` once module ``name`` is imported: now, or when its code has run."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, patch))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds one module with the other finders, and patches it once its code has run."""

    def __init__(self, name: str, patch: Any) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, original, patch = spec.loader, spec.loader.exec_module, self.patch

        def exec_module(module: Any) -> None:
            original(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _load(name: str) -> Any:
    """``workers/runtime/<name>.py`` by path: the script's ``sys.path`` need not hold the project."""
    spec = importlib.util.spec_from_file_location(f"_torchyard_{name}", os.path.join(_RUNTIME, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def _on_torch(torch: Any) -> None:
    try:
        _state.torch = torch
        _state.comm, _state.steplog = _load("comm"), _load("steplog")
        optimizer = importlib.import_module("torch.optim.optimizer")  # torch loads some submodules lazily
        optimizer.register_optimizer_step_post_hook(_after_optimizer_step)
        module = importlib.import_module("torch.nn.modules.module")
        _state.first_forward = module.register_module_forward_pre_hook(_first_forward)
        _patch_backward(torch)
        _patch_ddp(importlib.import_module("torch.nn.parallel.distributed").DistributedDataParallel)
        if torch.distributed.is_available():
            _patch_collectives(torch.distributed)
            _after_import(FUNCTIONAL_COLLECTIVES, _on_functional_collectives)
    except Exception:
        _fail("setup")


def _on_functional_collectives(module: Any) -> None:
    """DTensor's collectives (tensor parallelism, ``distribute_tensor``, loss parallel) go to C++
    functional ops, never through ``torch.distributed.*``: timed where they are issued."""
    try:
        if not _state.disabled:
            _state.comm.patch_functional_collectives(lambda: _timing("functional collective"))
    except Exception:
        _fail("functional collectives")


# ---- steps ----------------------------------------------------------------------------------


def _first_forward(module: Any, args: Any) -> None:
    try:
        if _state.first_forward is not None:
            _state.first_forward.remove()
            _state.first_forward = None
        if not _state.disabled and _state.step == 0:
            _begin(1)
    except Exception:
        _fail("the first forward")


def _begin(step: int) -> None:
    if _state.timer is None:
        torch, dist = _state.torch, _state.torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        if _state.device is None and distributed and "nccl" in str(dist.get_backend()):
            _state.device = torch.device("cuda", torch.cuda.current_device())  # events, not wall clock
        device = _state.device or torch.device("cpu")
        _state.timer = _state.comm.CommTimer(world, device)
        _state.steps = _state.steplog.StepLog(_state.timer, _log_floats, efficiency=False)  # no calibration here
        if distributed:
            _state.comm_timed = True  # every step reports comm figures (0 without collectives)
    _state.step, _state.samples = step, 0
    _state.loss_sum, _state.loss_count = None, 0
    _state.timer.begin_step(step)


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _state.disabled:
        return
    try:
        if _state.primary is None:
            _state.primary = weakref.ref(optimizer)
        elif _state.primary() is not optimizer:
            return
        if _state.step == 0:  # no forward before the first step: measure from here on
            _begin(1)
            return
        per_step = {"samples_per_s": float(_state.samples)} if _state.samples else {"steps_per_s": 1.0}
        steps = _state.steps
        steps.comm = _state.comm_timed  # a script without a process group: no comm figures
        loss = None
        if _state.loss_count and not _sdk().logs_own_loss():
            loss = _state.loss_sum / _state.loss_count
        steps.hold(_state.step, {}, per_step, loss=loss)
        if steps.end_step() and not _state.exit_flush:
            _state.exit_flush = True
            atexit.register(_flush_at_exit)  # after the SDK's own: runs before it (atexit is LIFO)
        _begin(_state.step + 1)
    except Exception:
        _fail("optimizer.step")


def _sdk() -> Any:
    import torchyard.sdk

    return torchyard.sdk


def _log_floats(step: int, values: dict[str, float]) -> None:
    _sdk().log_floats(step, values)


def _patch_backward(torch: Any) -> None:
    """Notes the loss of a script that never logs one: the one-element tensor it calls ``backward()``
    on. Through a GradScaler that tensor is the scaled loss, so ``scale`` leaves the unscaled one on
    what it returns."""
    backward = torch.Tensor.backward

    def noted_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _state.disabled and _state.step:
            try:
                if self.numel() == 1:
                    loss = getattr(self, "_torchyard_unscaled", self).detach().reshape(())
                    _state.loss_sum = loss if _state.loss_sum is None else _state.loss_sum + loss
                    _state.loss_count += 1
            except Exception:
                _fail("backward")
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = functools.wraps(backward)(noted_backward)
    scaler_class = importlib.import_module("torch.amp.grad_scaler").GradScaler
    scale = scaler_class.scale

    def noted_scale(self: Any, outputs: Any) -> Any:
        scaled = scale(self, outputs)
        if isinstance(outputs, torch.Tensor) and isinstance(scaled, torch.Tensor) and scaled is not outputs:
            try:
                scaled._torchyard_unscaled = outputs
            except Exception:
                _fail("GradScaler.scale")
        return scaled

    scaler_class.scale = functools.wraps(scale)(noted_scale)


def _flush_at_exit() -> None:
    try:
        if not _state.disabled and _state.steps is not None:
            _state.steps.flush()  # CUDA: the last step's events
    except Exception:
        _fail("exit")


# ---- DDP ------------------------------------------------------------------------------------


def _patch_ddp(ddp_class: Any) -> None:
    init, register, register_builtin = (
        ddp_class.__init__,
        ddp_class.register_comm_hook,
        ddp_class._register_builtin_comm_hook,
    )

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _state.disabled:
            return
        try:
            self._torchyard_hooked = False
            param = next(iter(self.module.parameters()), None)
            if param is not None and (_state.device is None or param.device.type == "cuda"):
                _state.device = param.device
            self.register_forward_pre_hook(_ddp_forward, with_kwargs=True)
            if int(os.environ.get("RANK", "0")) == 0:
                print("torchyard: timing DDP communication and optimizer steps (no change to the script)", flush=True)
        except Exception:
            _fail("DistributedDataParallel()")

    def register_comm_hook(self: Any, state: Any, hook: Any) -> Any:
        if _state.disabled or getattr(self, "_torchyard_hooked", None) is None:
            return register(self, state, hook)
        self._check_comm_hook(hook)  # the script's own errors stay its own
        self._torchyard_hooked = True
        try:
            wrapped = _timed_hook(hook)
        except Exception:
            _fail("register_comm_hook")
            wrapped = hook
        return register(self, state, wrapped)

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> Any:
        self._torchyard_hooked = True  # ours would collide with it; it stays untimed
        return register_builtin(self, comm_hook_type)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    ddp_class.__init__ = __init__
    ddp_class.register_comm_hook = register_comm_hook
    ddp_class._register_builtin_comm_hook = _register_builtin_comm_hook
    _state.register_original = register


def _ddp_forward(module: Any, args: Any, kwargs: Any) -> None:
    if _state.disabled:
        return
    try:
        if module._torchyard_hooked is False:
            module._torchyard_hooked = True
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            _state.register_original(module, None, _timed_hook(default_hooks.allreduce_hook))
        if module.training and _state.torch.is_grad_enabled():
            for value in (*args, *kwargs.values()):
                if isinstance(value, _state.torch.Tensor) and value.dim() > 0:
                    _state.samples += int(value.shape[0])
                    break
    except Exception:
        _fail("DDP forward")


def _timed_hook(hook: Any) -> Any:
    """``hook`` with each bucket's collective timed from the hook's call to its future's completion;
    the last bucket marks the end of backward compute (exposed comm = the tail after it)."""
    comm = _state.comm

    def timed_hook(state: Any, bucket: Any) -> Any:
        timer = _state.timer
        if _state.disabled or timer is None:
            return hook(state, bucket)
        try:
            start, _last = timer.begin_bucket(bucket)
            size = comm.tensor_bytes(bucket.buffer())
        except Exception:
            _fail("the comm hook")
            return hook(state, bucket)
        local = _state.local
        depth, seen = getattr(local, "hook_depth", 0), getattr(local, "hook_comm", False)
        local.hook_depth, local.hook_comm = depth + 1, False
        try:
            future = hook(state, bucket)
        finally:
            issued, local.hook_depth, local.hook_comm = local.hook_comm, depth, seen
        try:  # a hook that called dist.* (torch's allreduce_hook does): those calls carry the bytes
            return timer.track(comm.ALL_REDUCE, 0 if issued else size, start, future)
        except Exception:
            _fail("the comm hook")
            return future

    timed_hook.__annotations__ = {}  # DDP checks annotations as objects; none is accepted
    timed_hook.__qualname__ = getattr(hook, "__qualname__", "timed_hook")
    _state.comm_timed = True
    return timed_hook


# ---- the script's own collectives -------------------------------------------------------------


def _tensors_bytes(tensors: Any) -> int:
    return sum(_state.comm.tensor_bytes(t) for t in tensors)


def _arg(index: int, name: str) -> Any:
    """The argument at ``index`` (positional) or ``name`` (keyword) of a call."""

    def get(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return args[index] if len(args) > index else kwargs[name]

    return get


def _bytes_of(index: int, name: str, many: bool = False) -> Any:
    get = _arg(index, name)
    if many:
        return lambda args, kwargs: _tensors_bytes(get(args, kwargs))
    return lambda args, kwargs: _state.comm.tensor_bytes(get(args, kwargs))


# name: (kind, bytes of a call: nccl-tests' convention)
_COLLECTIVES: dict[str, tuple[str, Any]] = {
    "all_reduce": ("all_reduce", _bytes_of(0, "tensor")),
    "all_gather": ("all_gather", _bytes_of(0, "tensor_list", many=True)),
    "all_gather_into_tensor": ("all_gather", _bytes_of(0, "output_tensor")),
    "all_gather_single": ("all_gather", _bytes_of(0, "output_tensor")),  # FSDP2
    "reduce_scatter": ("reduce_scatter", _bytes_of(1, "input_list", many=True)),
    "reduce_scatter_tensor": ("reduce_scatter", _bytes_of(1, "input")),
    "reduce_scatter_single": ("reduce_scatter", _bytes_of(1, "input")),  # FSDP2
    "broadcast": ("broadcast", _bytes_of(0, "tensor")),
    "reduce": ("reduce", _bytes_of(0, "tensor")),
    "all_to_all": ("all_to_all", _bytes_of(1, "input_tensor_list", many=True)),
    "all_to_all_single": ("all_to_all", _bytes_of(1, "input")),
    "send": ("send_recv", _bytes_of(0, "tensor")),
    "recv": ("send_recv", _bytes_of(0, "tensor")),
}
# FSDP2 checks these works' type (``isinstance(work, Work)``): hand the Work itself back, timed by
# its future's callback only
_KEEP_WORK = {"all_gather_single", "reduce_scatter_single"}


def _patch_collectives(dist: Any) -> None:
    for name, (kind, nbytes) in _COLLECTIVES.items():
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, "_torchyard_original"):
            setattr(dist, name, _timed_collective(name, kind, nbytes, fn))
    fn = getattr(dist, "batch_isend_irecv", None)
    if fn is not None and not hasattr(fn, "_torchyard_original"):
        dist.batch_isend_irecv = _timed_batch_p2p(fn)


def _timing(name: str) -> Any:
    """The timer, when a step is being measured and this call is ours to time; else None."""
    timer = _state.timer
    if _state.disabled or timer is None or timer.step == 0:
        return None
    return timer


def _timed_collective(name: str, kind: str, nbytes: Any, fn: Any) -> Any:
    params = list(inspect.signature(fn).parameters)
    async_at = params.index("async_op") if "async_op" in params else -1
    keep_work = name in _KEEP_WORK

    def collective(*args: Any, **kwargs: Any) -> Any:
        timer = _timing(name)
        if timer is None:
            return fn(*args, **kwargs)
        try:
            size = nbytes(args, kwargs)
            is_async = async_at >= 0 and bool(args[async_at] if len(args) > async_at else kwargs.get("async_op"))
            local = _state.local
            if getattr(local, "hook_depth", 0):  # inside a timed DDP hook: its interval covers this call
                local.hook_comm = True
                timer.add_bytes(kind, size)
                return fn(*args, **kwargs)
        except Exception:
            _fail(f"dist.{name}")
            return fn(*args, **kwargs)
        if not is_async:
            return timer.call(kind, size, fn, *args, **kwargs)
        start = timer.now()
        work = fn(*args, **kwargs)
        if work is None:  # not a member of the group
            return work
        try:
            if keep_work:
                timer.track(kind, size, start, work.get_future())  # its completion, in this step
                return work
            return timer.work(kind, size, start, work)
        except Exception:
            _fail(f"dist.{name}")
            return work

    collective.__wrapped__ = fn  # type: ignore[attr-defined]
    collective._torchyard_original = fn  # type: ignore[attr-defined]
    collective.__name__, collective.__qualname__, collective.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    return collective


def _timed_batch_p2p(fn: Any) -> Any:
    def batch_isend_irecv(p2p_op_list: Any) -> Any:
        timer = _timing("batch_isend_irecv")
        if timer is None:
            return fn(p2p_op_list)
        start = timer.now()
        works = fn(p2p_op_list)
        try:
            sizes = [_state.comm.tensor_bytes(op.tensor) for op in p2p_op_list]
            if len(works) != len(sizes):  # coalesced: one work for the batch
                sizes = [sum(sizes)] + [0] * (len(works) - 1)
            return [timer.work("send_recv", size, start, w) for w, size in zip(works, sizes, strict=True)]
        except Exception:
            _fail("dist.batch_isend_irecv")
            return works

    batch_isend_irecv.__wrapped__ = fn  # type: ignore[attr-defined]
    batch_isend_irecv._torchyard_original = fn  # type: ignore[attr-defined]
    batch_isend_irecv.__doc__ = fn.__doc__
    return batch_isend_irecv
