"""Parameter-server training with bounded staleness (``async``).

Rank 0 is the server: it holds the model and the optimizer and applies gradients as they arrive.
Ranks 1..N-1 are workers: each computes a gradient on its batch with the parameters it holds,
pushes it to the server and pulls the parameters back, with no barrier between workers.

**Versions and staleness.** The server's parameters have a version, one more per optimizer step.
A worker computes on the version it last pulled (its *base*); its gradient is applied at the
server's current version, ``staleness`` = current − base versions late.

- ``max_staleness`` = 0, synchronous: the server waits for one gradient from every worker, averages
  them (each divided by the workers, then summed: DDP's order) and steps once per version; every
  worker then pulls the new version. The same updates as DDP over the workers (the tests hold the
  losses to DDP's within 1e-4).
- ``max_staleness`` = s ≥ 1: every gradient is a step of its own, applied as it arrives unless
  applying it would leave another worker's base more than s versions behind (that worker's next
  gradient could not be applied within the bound). **A worker that is ahead waits in its pull**:
  the server keeps its gradient, and its reply, until the slower workers' gradients have moved
  their bases on. So every applied gradient is at most s versions late. Workers that start
  together compute on one version, and their first gradients are applied 0, 1, .. workers − 1
  versions late: s < workers − 1 could never proceed, and the spec refuses it.

**Sync points** (every ``checkpoint_every`` steps and the last step): a worker that has pushed the
gradient of such a step gets its reply only once every worker has, so all of them go on from one
version, and the server's model there is the whole run's (a checkpoint's, or the final one).
Between two sync points the server applies workers × steps gradients, a loop step of the server
being one gradient per worker (one averaged version at s = 0): every rank runs the same number of
loop steps, and the checkpoint's collective save finds every rank at the same step.

**Replay (tests)**: with a ``schedule_seed`` the server applies the gradients in an order drawn
from that seed, not in their arrival order: before each update it draws the worker whose gradient
comes next from those the bound lets through, and keeps any other worker's gradient until that
one's has arrived. Every gradient is then computed on, and applied at, the same version in every
run of one spec and seed, so the run replays exactly (a stale run's loss no longer depends on the
machine's timing). Without it (the default, what a spec runs) gradients are applied as they arrive.

**Checkpoints**: the server saves the model, the optimizer and its versions; the workers save
nothing (their parameters are a version the server had). A resumed worker's first step pulls the
server's parameters before it computes.

**Transport: point-to-point ``isend``/``irecv`` on a Gloo group of its own, not
``torch.distributed.rpc``.** RPC still works in torch 2.13 on CPU (tried: ``init_rpc`` and
``rpc_sync`` between two processes), but it is a second stack beside the process group torchrun
sets up: the TensorPipe agent with its own rendezvous, thread pool and timeouts, and server state
updated from its threads. Point-to-point on c10d keeps everything in the one stack the rest of the
platform knows: each push and pull goes through :meth:`CommTimer.work` like a pipeline's sends
(``comm_bytes_send_recv``; Gloo's send/recv have no future, so an op's interval ends when its
``wait()`` returns), and a hung run's Flight Recorder dump and the checkpoint's collectives see the
same ranks. The server waits for whichever worker pushes first with an any-source ``irecv``
(Gloo's ``recv_anysource``) on its own tag. The group of its own keeps this traffic apart from
the world group's collectives (checkpoints).

Per-step figures beside the common ones: on a worker ``staleness`` (how late its gradient was
applied), ``wait_s`` (how long the server kept it waiting after its gradient arrived: for the
others' gradients at s = 0, for the bound, a sync point or its own update), ``push_bytes``,
``push_time_s`` (posting the gradient until its send completed), ``pull_bytes``, ``pull_time_s``
(posting the receive until the parameters were in: includes ``wait_s``) and ``version``. On the
server: ``version``, ``staleness_max`` over the gradients it applied in the step, ``push_bytes``
(gradients received) and ``pull_bytes`` (parameters sent).
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from torchyard import spec as specs
from workers.runtime.comm import SEND_RECV, CommTimer, tensor_bytes
from workers.runtime.strategies.base import Strategy
from workers.runtime.workloads import Batch, Workload

SERVER = 0
GRAD, HEADER, PARAMS = (
    1,
    2,
    3,
)  # tags: a worker's push; the server's reply (version, staleness, wait_s), then its parameters


class AsyncStrategy(Strategy):
    kind = "async"

    def __init__(
        self,
        cfg: specs.AsyncConfig,
        training: specs.TrainingConfig,
        workload: Workload,
        device: torch.device,
        timer: CommTimer | None,
        lr: float,
        schedule_seed: int | None = None,
    ) -> None:
        super().__init__(workload, device, timer, lr)
        assert device.type == "cpu", "Gloo send/recv of CPU tensors (the spec refuses cuda)"
        self.cfg, self.training = cfg, training
        self.rank = dist.get_rank()
        self.workers = list(range(1, dist.get_world_size()))
        self.group = dist.new_group(backend="gloo")
        self.params = list(self.model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.version = 0
        self.started = False  # the first step begins with the workers pulling the server's parameters
        self.step_figures: dict[str, float] = {}
        if self.rank == SERVER:
            # Stale: each gradient is a step of lr / workers, so that a round of the workers' gradients
            # moves the model as far as one synchronous step does, and a run compares with DDP at the
            # same lr and step count. At the full lr (twice the steps, each on half the batch, for 2
            # workers) the mlp's loss levelled off 9-11 % above DDP's; see README.
            step_lr = lr if cfg.max_staleness == 0 else lr / len(self.workers)
            self.optimizer = workload.make_optimizer(self.params, step_lr)
            self.base = dict.fromkeys(self.workers, 0)  # the version each worker computes on
            self.pushed = dict.fromkeys(self.workers, 0)  # gradients of each worker applied: its steps
            self.pending: deque[tuple[int, Tensor, float]] = deque()  # (worker, gradient, arrival): kept back
            # worker -> (its gradient's arrival, its staleness): applied, answered at the sync point
            self.held: dict[int, tuple[float, int]] = {}
            # tests: the order of the updates drawn from a seed, not the arrival order (see Replay)
            self.schedule = None if schedule_seed is None else random.Random(schedule_seed)
            self.due: int | None = None  # the worker whose gradient the schedule applies next

    # -- the worker ------------------------------------------------------------------------------

    def train_step(self, batch: Batch) -> Tensor | None:
        self.step_figures = {}
        if self.rank == SERVER:
            self.serve()
            return None
        if not self.started:
            self.finish_pull(*self.post_pull())
            self.started = True
            self.step_figures = {}
        for p in self.params:
            p.grad = None
        loss = self.workload.loss(self.model, batch)
        loss.backward()
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        start, push = self.post(dist.isend, grad, SERVER, GRAD)
        reply = self.post_pull()  # posted at once: the server answers as soon as it may
        push.wait()
        self.step_figures.update(push_bytes=float(tensor_bytes(grad)), push_time_s=time.perf_counter() - start)
        self.finish_pull(*reply)
        return loss

    def post_pull(self) -> tuple[float, Tensor, Tensor, Any, Any]:
        """Post the receives of the server's reply: (version, staleness of the gradient just pushed,
        wait_s), then the parameters."""
        header, flat = torch.empty(3, dtype=torch.float64), torch.empty(self.numel)
        start, got_header = self.post(dist.irecv, header, SERVER, HEADER)
        _, got_params = self.post(dist.irecv, flat, SERVER, PARAMS)
        return start, header, flat, got_header, got_params

    def finish_pull(self, start: float, header: Tensor, flat: Tensor, got_header: Any, got_params: Any) -> None:
        got_header.wait()
        got_params.wait()
        vector_to_parameters(flat, self.params)
        version, staleness, waited = header.tolist()
        self.version = int(version)
        self.step_figures.update(
            version=version,
            staleness=staleness,
            wait_s=waited,
            pull_bytes=float(tensor_bytes(header) + tensor_bytes(flat)),
            pull_time_s=time.perf_counter() - start,
        )

    def post(self, op: Any, tensor: Tensor, peer: int | None, tag: int) -> tuple[float, Any]:
        """Post a send or receive on the group; timed (``send_recv``) when there is a timer."""
        start = time.perf_counter()
        work = op(tensor, peer, group=self.group, tag=tag)
        if self.timer is not None:
            work = self.timer.work(SEND_RECV, tensor_bytes(tensor), self.timer.now(), work)
        return start, work

    # -- the server ------------------------------------------------------------------------------

    def serve(self) -> None:
        """One loop step of the server: one averaged version (s = 0), else one gradient per worker."""
        self.step_figures = {"push_bytes": 0.0, "pull_bytes": 0.0, "staleness_max": 0.0}
        if not self.started:
            for worker in self.workers:  # the first parameters (a resumed run's: the checkpoint's)
                self.reply(worker, 0, 0.0)
            self.started = True
        if self.cfg.max_staleness == 0:
            arrived: dict[int, tuple[Tensor, float]] = {}
            while len(arrived) < len(self.workers):
                worker, grad, at = self.receive()
                arrived[worker] = (grad, at)
            k = len(self.workers)
            self.apply(sum(arrived[w][0] / k for w in self.workers))  # type: ignore[arg-type]
            for worker in self.workers:
                self.answer(worker, 0, arrived[worker][1])
        else:
            for _ in self.workers:
                while (ready := self.next_ready()) is None:
                    self.pending.append(self.receive())
                worker, grad, at = ready
                staleness = self.version - self.base[worker]
                self.apply(grad)
                self.answer(worker, staleness, at)
        self.step_figures["version"] = float(self.version)

    def receive(self) -> tuple[int, Tensor, float]:
        """The next gradient any worker pushes: (worker, gradient, when it arrived)."""
        grad = torch.empty(self.numel)
        _, work = self.post(dist.irecv, grad, None, GRAD)
        work.wait()
        self.step_figures["push_bytes"] += tensor_bytes(grad)
        return dist.get_global_rank(self.group, work._source_rank()), grad, time.perf_counter()

    def next_ready(self) -> tuple[int, Tensor, float] | None:
        """The first kept gradient that the bound lets through; with a schedule, the gradient of the
        worker it draws from those the bound lets through, once it has arrived."""
        if self.schedule is not None and self.due is None:
            # every worker not held at a sync point has pushed, or will push, its next gradient
            self.due = self.schedule.choice([w for w in self.workers if w not in self.held and self.within_bound(w)])
        for i, (worker, grad, at) in enumerate(self.pending):
            if (worker == self.due) if self.schedule is not None else self.within_bound(worker):
                del self.pending[i]
                self.due = None
                return worker, grad, at
        return None

    def within_bound(self, worker: int) -> bool:
        """Applying the worker's gradient (one more version) leaves no other worker that will push
        again before the sync point more than s versions behind."""
        others = (u for u in self.workers if u != worker and u not in self.held)
        return all(self.version + 1 - self.base[u] <= self.cfg.max_staleness for u in others)

    def apply(self, grad: Tensor) -> None:
        assert self.optimizer is not None
        offset = 0
        for p in self.params:
            p.grad = grad[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.optimizer.step()
        self.version += 1

    def answer(self, worker: int, staleness: int, arrived: float) -> None:
        """Answer the worker's push; past a sync point, once every worker has reached it."""
        self.step_figures["staleness_max"] = max(self.step_figures["staleness_max"], float(staleness))
        self.pushed[worker] += 1
        if self.cfg.max_staleness and not self.at_sync_point(self.pushed[worker]):
            self.reply(worker, staleness, time.perf_counter() - arrived)
            return
        self.held[worker] = (arrived, staleness)  # s = 0: every version is a sync point
        if len(self.held) == len(self.workers):
            for w, (at, late) in sorted(self.held.items()):
                self.reply(w, late, time.perf_counter() - at)
            self.held.clear()

    def at_sync_point(self, step: int) -> bool:
        every = self.training.checkpoint_every
        return step == self.training.steps or bool(every and step % every == 0)

    def reply(self, worker: int, staleness: int, waited: float) -> None:
        header = torch.tensor([float(self.version), float(staleness), waited], dtype=torch.float64)
        flat = parameters_to_vector(self.params).detach()
        for tensor, tag in ((header, HEADER), (flat, PARAMS)):
            _, work = self.post(dist.isend, tensor, worker, tag)
            work.wait()
            self.step_figures["pull_bytes"] += tensor_bytes(tensor)
        self.base[worker] = self.version

    # -- the rest of the interface ---------------------------------------------------------------

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else self.lr0

    def data_shard(self, rank: int, world: int) -> tuple[int, int]:
        """The workers split the data; the server reads the first worker's shard (and leaves it)."""
        return max(rank - 1, 0), world - 1

    def extra_metrics(self) -> dict[str, float]:
        return self.step_figures

    def state_dict(self) -> dict[str, Any]:
        """The server's model, optimizer and versions; nothing from a worker (its parameters are a
        version the server had, and a resumed worker pulls the server's before its first step)."""
        if self.rank != SERVER:
            return {}
        state = super().state_dict()
        state["ps"] = {"version": torch.tensor(self.version), "pushed": torch.tensor(list(self.pushed.values()))}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.rank != SERVER:
            return
        super().load_state_dict(state)
        self.version = int(state["ps"]["version"])
        self.pushed = dict(zip(self.workers, (int(n) for n in state["ps"]["pushed"]), strict=True))

    def describe(self) -> str:
        role = "server" if self.rank == SERVER else "worker"
        return f"async/max_staleness={self.cfg.max_staleness} ({role})"
