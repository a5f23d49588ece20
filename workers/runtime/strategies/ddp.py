"""DDP with torch's own gradient communication hooks (all-reduce, fp16/bf16 compression,
PowerSGD), each wrapped so that every bucket's collective is timed.

The wrapper calls torch's hook unchanged and records [hook call, future done] per bucket with the
bytes that went on the wire (fp16/bf16: 2 per element; PowerSGD: its P, Q and uncompressed
all-reduces, counted where ``powerSGD_hook`` issues them). The last bucket's hook queues an autograd
final callback that marks the end of backward compute (where DDP's own logging marks it): from then
until the last bucket's comm ends, the step waits for communication (``exposed_comm_s``).

PowerSGD on Gloo: its P and Q all-reduces are issued from future callbacks, which Gloo runs on its
worker threads when the previous all-reduce completes. With more than one bucket, bucket k's P
all-reduce and bucket k+1's first all-reduce race on each rank, so the ranks can issue collectives
in different orders and Gloo pairs mismatched buffers ("Received data size doesn't match expected
size"; seen with 6× Linear(1024), which fills several buckets, while a small MLP fits in one). On
Gloo we therefore put all gradients in one bucket (``bucket_cap_mb`` ≥ the gradients' size), which
keeps the collective order identical on every rank. On NCCL the callbacks run in the issuing
thread, in order, and the default buckets are kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from torchyard import spec as specs
from workers.runtime.comm import ALL_REDUCE, CommTimer, patch_dist, tensor_bytes
from workers.runtime.strategies.base import Strategy, plain_step
from workers.runtime.workloads import Batch, Workload

Hook = Callable[[Any, Any], torch.futures.Future[Tensor]]


def as_hook(fn: Hook) -> Hook:
    """DDP checks a hook's annotations as objects; under ``from __future__ import annotations``
    they are strings, so set the real ones."""
    fn.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return fn


def _slow_peer(hook: Hook, delay_s: float, timer: CommTimer) -> Hook:
    """Tests: this rank joins the last bucket's all-reduce ``delay_s`` late on even steps, before its
    own timer starts. Its peers wait for it inside the collective itself, so the delay shows only in
    their comm figures, through the real wait: the proof that comm and exposed time are measured."""

    def late(state: Any, bucket: Any) -> torch.futures.Future[Tensor]:
        if bucket.is_last() and timer.step % 2 == 0:
            time.sleep(delay_s)
        return hook(state, bucket)

    return as_hook(late)


class DdpStrategy(Strategy):
    kind = "ddp"

    def __init__(
        self,
        cfg: specs.DdpConfig | None,
        workload: Workload,
        device: torch.device,
        timer: CommTimer | None,
        lr: float,
        ddp_logging: bool = False,
        slow_peer_s: float = 0.0,
    ) -> None:
        super().__init__(workload, device, timer, lr)
        self.cfg = cfg or specs.DdpConfig(kind="ddp")
        module = workload.model.to(device)
        cuda = device.type == "cuda"
        grad_mb = sum(tensor_bytes(p) for p in module.parameters()) / 2**20
        one_bucket = self.cfg.comm_hook == "powersgd" and not cuda
        self.ddp = DistributedDataParallel(
            module,
            device_ids=[device.index] if cuda else None,
            bucket_cap_mb=int(grad_mb) + 1 if one_bucket else None,
        )
        self.model = self.ddp
        self.ddp_logging = ddp_logging
        if ddp_logging:
            self.ddp._set_ddp_runtime_logging_sample_rate(1)
        state, hook, nbytes = self.make_hook()
        # untimed, torch's all-reduce hook is DDP's built-in C++ all-reduce (the same averaging,
        # without a Python call per bucket and a Python callback per future): what an unmodified
        # script runs, so the bare baseline the overhead benchmark holds the instrumentation to
        self.builtin_allreduce = timer is None and hook is default_hooks.allreduce_hook
        if not self.builtin_allreduce:
            hook = self.timed(hook, nbytes) if timer else hook
            if slow_peer_s and timer and dist.get_rank() == dist.get_world_size() - 1:
                hook = _slow_peer(hook, slow_peer_s, timer)
            self.ddp.register_comm_hook(state, hook)
        self.optimizer = self.make_optimizer()

    def make_optimizer(self) -> torch.optim.Optimizer:
        return self.workload.make_optimizer(self.ddp.parameters(), self.lr0)

    def make_hook(self) -> tuple[Any, Hook, Callable[[Any, Any], int]]:
        """(state, torch's hook, bytes the hook puts on the wire for a bucket)."""
        cfg = self.cfg

        def full(state: Any, bucket: Any) -> int:
            return tensor_bytes(bucket.buffer())

        def half(state: Any, bucket: Any) -> int:
            return bucket.buffer().numel() * 2

        if cfg.comm_hook == "allreduce":
            return None, default_hooks.allreduce_hook, full
        if cfg.comm_hook == "fp16":
            return None, default_hooks.fp16_compress_hook, half
        if cfg.comm_hook == "bf16":
            return None, default_hooks.bf16_compress_hook, half
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_warmup,
            min_compression_rate=2,
            random_seed=0,
        )
        if self.timer is not None:  # P, Q and uncompressed all-reduces: count their bytes
            self._undo.append(patch_dist(powerSGD_hook, self.timer, bytes_only=True))

        def powersgd_bytes(state: Any, bucket: Any) -> int:
            # before start_powerSGD_iter the hook is a plain all-reduce (not seen by the patch)
            return tensor_bytes(bucket.buffer()) if state.iter < state.start_powerSGD_iter else 0

        return state, powerSGD_hook.powerSGD_hook, powersgd_bytes

    def timed(self, hook: Hook, nbytes: Callable[[Any, Any], int]) -> Hook:
        timer = self.timer
        assert timer is not None

        def timed_hook(state: Any, bucket: Any) -> torch.futures.Future[Tensor]:
            start, _last = timer.begin_bucket(bucket)
            return timer.track(ALL_REDUCE, nbytes(state, bucket), start, hook(state, bucket))

        return as_hook(timed_hook)

    def train_step(self, batch: Batch) -> Tensor:
        assert self.optimizer is not None
        return plain_step(self.ddp, self.optimizer, self.workload, batch)

    def extra_metrics(self) -> dict[str, float]:
        if not self.ddp_logging:
            return {}
        data = self.ddp._get_ddp_logging_data()
        out = {}
        for prefix in ("", "avg_"):
            comm = float(data.get(f"{prefix}backward_comm_time", 0)) / 1e9
            overlap = float(data.get(f"{prefix}backward_compute_comm_overlap_time", 0)) / 1e9
            out[f"ddp_{prefix}backward_comm_s"] = comm
            out[f"ddp_{prefix}exposed_comm_s"] = comm - overlap
        return out

    def describe(self) -> str:
        return f"ddp/{self.cfg.comm_hook}"
