"""A step's metrics, complete: :class:`StepLog` joins the loop's own scalars for a step with the
step timer's figures (:class:`workers.runtime.comm.CommTimer`) and the memory high-water marks,
and logs them. Used by the training loop, the unmodified-script instrumentation (which loads this
file by path, next to ``comm.py``: only torch and the standard library here) and the overhead
benchmark."""

from __future__ import annotations

import resource
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.runtime.comm import CommTimer

# Linux: a thread's ru_maxrss is the process's (the mm's high-water mark), and asking for the
# thread does not walk every thread of the process as RUSAGE_SELF does
_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def memory_figures(device: torch.device) -> dict[str, float]:
    out = {"max_rss_bytes": float(resource.getrusage(_RUSAGE).ru_maxrss * 1024)}  # Linux: KiB
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(device))
    return out


class StepLog:
    """The one place a step's metrics come together. The loop holds a logged step's own scalars
    (``lr``, ``data_time_s``, ...) here, with its loss tensor and the counts that become rates,
    until the timer's figures for the step are readable (at its end on CPU, a step later on CUDA);
    then they get ``step_time_s`` (the timer's begin/end marks: on CUDA events, so no device-wide
    sync), the rates (``samples_per_s`` = samples / step_time_s, ...), ``loss``,
    ``compute_time_s`` (step − data − exposed comm), the comm figures, ``comm_fraction`` and the
    memory high-water marks, and go to ``log`` (``torchyard.sdk.log_floats``). ``comm=False``: no
    collectives are timed (a script without a process group); ``efficiency=False``: no
    calibration ran."""

    def __init__(
        self,
        timer: CommTimer,
        log: Callable[[int, dict[str, float]], None],
        comm: bool = True,
        efficiency: bool = True,
    ) -> None:
        self.timer, self.log, self.comm, self.efficiency = timer, log, comm, efficiency
        self.pending: dict[int, tuple[dict[str, float], dict[str, float], torch.Tensor | None]] = {}

    def hold(
        self,
        step: int,
        scalars: dict[str, float],
        per_step: dict[str, float] | None = None,
        loss: torch.Tensor | None = None,
    ) -> None:
        """Before :meth:`end_step`. ``per_step``: rate name -> count in this step (``samples_per_s``:
        the batch). ``loss``: read when the figures are; on CUDA copied to the host here without
        waiting, in stream order before the step's end mark, so it is there when that mark is."""
        if loss is not None:
            loss = loss.detach()
            if loss.is_cuda:
                loss = loss.to("cpu", non_blocking=True)  # into pinned memory: no sync
        self.pending[step] = (scalars, per_step or {}, loss)

    def end_step(self) -> int:
        """Close the timer's step and log every held step whose figures are now readable; returns
        how many were logged. A step not held is not worked out at all (``log_every`` > 1)."""
        return self.emit(self.timer.end_step(keep=self.timer.step in self.pending))

    def flush(self) -> int:
        """Log what is still held (CUDA: the last step, whose events were not read yet)."""
        return self.emit(self.timer.flush())

    def emit(self, ready: list[tuple[int, dict[str, float]]]) -> int:
        logged = 0
        for step, fig in ready:
            held = self.pending.pop(step, None)
            if held is None:
                continue
            scalars, per_step, loss = held
            step_time = scalars["step_time_s"] = fig.pop("step_time_s")
            for name, count in per_step.items():
                scalars[name] = count / step_time if step_time > 0 else 0.0
            if loss is not None:
                scalars["loss"] = float(loss)
            if self.comm:
                exposed = fig["exposed_comm_s"]
                scalars["compute_time_s"] = max(0.0, step_time - scalars.get("data_time_s", 0.0) - exposed)
                del fig["comm_ops"]
                if not self.efficiency:
                    del fig["busbw_efficiency"]
                scalars.update(fig)
                scalars["comm_fraction"] = exposed / step_time if step_time > 0 else 0.0
            scalars.update(memory_figures(self.timer.device))
            self.log(step, scalars)
            logged += 1
        return logged
