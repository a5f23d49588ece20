"""This node's GPUs: the inventory its heartbeat offers the scheduler, which gives each CUDA share
GPUs of its own (``CUDA_VISIBLE_DEVICES``, set by ``workers/torchrun.py``).

Where the inventory comes from, the first that answers:

1. ``TORCHYARD_NODE_GPUS`` (e.g. ``0,1,2,3``): taken as given and never checked against the
   hardware (trusted), to pin a worker to some GPUs, or to test GPU placement on a machine that
   has none (its ranks must then never initialise CUDA).
2. NVML (``nvidia-ml-py``, where the driver's library loads): the driver's own list, with model and memory, without
   creating a CUDA context.
3. torch, in a child process, only where an NVIDIA driver is loaded (``/proc/driver/nvidia``): in a
   child so this worker never initialises CUDA itself (its Celery pool forks) and pays torch's
   import (2 s) only on a machine that may have a GPU.

Indices are the driver's, in PCI bus order (NVML's order; CUDA's too with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
which the probe and every CUDA rank get), limited to the worker's own ``CUDA_VISIBLE_DEVICES`` when
it lists plain indices."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torchyard.settings import Settings, parse_gpu_indices

log = logging.getLogger(__name__)

DRIVER = Path("/proc/driver/nvidia/version")  # present only while the NVIDIA kernel driver is loaded
PROBE_TIMEOUT_S = 120.0
_TORCH_PROBE = (
    "import json, torch\n"
    "n = torch.cuda.device_count()\n"
    "print(json.dumps([[i, torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory]"
    " for i in range(n)]))"
)


@dataclass(frozen=True)
class Gpu:
    index: int  # the driver's index (PCI bus order): what CUDA_VISIBLE_DEVICES names
    name: str  # the model, e.g. "NVIDIA H200"; "" when not known (TORCHYARD_NODE_GPUS)
    memory_bytes: int | None  # None when not known

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def inventory(settings: Settings) -> list[Gpu]:
    """The GPUs this node offers (see the module's docstring for where they come from)."""
    if settings.node_gpus.strip():
        return [Gpu(i, "", None) for i in parse_gpu_indices(settings.node_gpus, "TORCHYARD_NODE_GPUS")]
    found = _from_nvml()
    if found is None:
        found = _from_torch() if DRIVER.exists() else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and found:
        try:
            allowed = set(parse_gpu_indices(visible, "CUDA_VISIBLE_DEVICES")) if visible.strip() else set()
        except ValueError:
            log.warning(
                "CUDA_VISIBLE_DEVICES=%s is not a list of indices: offering every GPU; pin this worker with "
                "TORCHYARD_NODE_GPUS instead",
                visible,
            )
        else:
            found = [g for g in found if g.index in allowed]
    return found


def devices(settings: Settings, gpus: list[Gpu]) -> list[str]:
    """What this node runs: TORCHYARD_NODE_DEVICES, else cpu, and cuda where it has GPUs."""
    if settings.node_devices.strip():
        chosen = [d.strip() for d in settings.node_devices.split(",") if d.strip()]
        if "cuda" in chosen and not gpus:
            log.warning("TORCHYARD_NODE_DEVICES names cuda but this node has no GPU: it can place no CUDA run")
        return chosen
    return ["cpu", "cuda"] if gpus else ["cpu"]


def _from_nvml() -> list[Gpu] | None:
    """The driver's GPUs through NVML; None when NVML is not there to ask (no driver, no package)."""
    try:
        import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError: no libnvidia-ml, no driver
        return None
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            found.append(Gpu(i, name.decode() if isinstance(name, bytes) else str(name), memory))
        return found
    except Exception:
        log.warning("NVML could not list the GPUs; asking torch", exc_info=True)
        return None
    finally:
        pynvml.nvmlShutdown()


def _from_torch() -> list[Gpu]:
    """CUDA's count, model and memory, asked in a child process (every GPU of the machine, in PCI bus order)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    try:
        out = subprocess.run(
            [sys.executable, "-c", _TORCH_PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=True,
        ).stdout
        return [Gpu(int(i), str(name), int(memory)) for i, name, memory in json.loads(out.strip().splitlines()[-1])]
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        log.warning("could not count this node's GPUs with torch (%s): offering none", exc)
        return []
