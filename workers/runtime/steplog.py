"""A step's metrics, complete: :class:`StepLog` joins the loop's own scalars for a step with the
step timer's figures (:class:`workers.runtime.comm.CommTimer`) and the memory high-water marks,
and logs them. Used by the training loop, the unmodified-script instrumentation (which loads this
file by path, next to ``comm.py``: only torch and the standard library here) and the overhead
benchmark."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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


DATA_PARTS = ("data_time_s", "data_wait_s", "data_copy_s")  # data_time_s = data_wait_s + data_copy_s
GPU_SAMPLE_EVERY_S = 1.0  # an NVML query costs tens of µs; a step may take a millisecond


class GpuTelemetry:
    """The rank's own GPU through NVML (``nvidia-ml-py``): utilisation, memory in use, power and
    temperature, sampled at most once a second (so sparser than the steps). On CPU, without the
    package or without a driver there are no such metrics at all: absent, not zero."""

    def __init__(self, device: torch.device) -> None:
        self.handle: Any = None
        self.nvml: Any = None
        self.next_at = 0.0
        if device.type != "cuda":
            return
        try:
            import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py

            pynvml.nvmlInit()
            # By UUID: CUDA_VISIBLE_DEVICES renumbers devices for torch, never for NVML.
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            self.nvml = pynvml
        except Exception:  # no package, no driver, an old driver: no telemetry, training goes on
            self.handle = None

    def sample(self) -> dict[str, float]:
        """The device's figures when a second has passed since the last sample, else nothing."""
        if self.handle is None or time.monotonic() < self.next_at:
            return {}
        self.next_at = time.monotonic() + GPU_SAMPLE_EVERY_S
        nvml, handle = self.nvml, self.handle
        out: dict[str, float] = {}
        for key, read in (
            ("gpu_util_pct", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            ("gpu_mem_used_bytes", lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used),
            ("gpu_power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            ("gpu_temp_c", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        ):
            try:
                out[key] = float(read())
            except Exception:  # a figure this board does not report (power on some)
                continue
        return out


class StepLog:
    """The one place a step's metrics come together. The loop holds a logged step's own scalars
    (``lr``, ``data_time_s``, ...) here, with its loss tensor and the counts that become rates,
    until the timer's figures for the step are readable (at its end on CPU, a step later on CUDA);
    then they get ``step_time_s`` (the timer's begin/end marks: on CUDA events, so no device-wide
    sync), the rates (``samples_per_s`` = samples / step_time_s, ...), ``loss``,
    ``compute_time_s`` (step − data − exposed comm), the comm figures, ``comm_fraction`` and the
    memory high-water marks and (CUDA, once a second) the GPU's NVML figures, and go to ``log`` (``torchyard.sdk.log_floats``). ``comm=False``: no
    collectives are timed (a script without a process group); ``efficiency=False``: no
    calibration ran."""

    def __init__(
        self,
        timer: CommTimer,
        log: Callable[[int, dict[str, float]], None],
        comm: bool = True,
        efficiency: bool = True,
    ) -> None:
        self.timer, self.log, self.efficiency = timer, log, efficiency
        # One rank: its "collectives" (DDP still all-reduces, on a group of one) move nothing over
        # any wire, so no comm figure is logged: 2 MB/step of comm bytes and a comm fraction above
        # zero on a 1-rank run misled more than they told.
        self.comm = comm and timer.world > 1
        self.telemetry = GpuTelemetry(timer.device)
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
            for key in DATA_PARTS:  # marked on the timer's clock (CommTimer.batch_ready, data_ready)
                if key in fig:
                    scalars[key] = fig.pop(key)
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
            scalars.update(self.telemetry.sample())
            self.log(step, scalars)
            logged += 1
        return logged
