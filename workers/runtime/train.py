"""The rank entrypoint the launcher runs under torch elastic:

    python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node N -m workers.runtime.train

Reads the run spec (JSON of :class:`torchyard.spec.RunSpec`) from ``TORCHYARD_SPEC``; the process
group from torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``;
metrics go through :mod:`torchyard.sdk` (``TORCHYARD_RANK_REDIS_URL``, ``TORCHYARD_RUN_ID``,
``TORCHYARD_ATTEMPT``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import torchyard
from torchyard import data
from torchyard.facts import RunFacts
from torchyard.spec import RunSpec
from workers.runtime import checkpoint, errorfile, hangdump, profiling, strategies
from workers.runtime.calibrate import calibrate
from workers.runtime.comm import CommTimer
from workers.runtime.steplog import StepLog
from workers.runtime.workloads import Batch, Workload, as_batch, build

_cancel = {"save": False, "requested": False}  # save on cancel: set in main(); the SIGTERM handler notes one


def say(line: str) -> None:
    """One write per line, so the lines of ranks sharing a stdout do not interleave mid-line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def batches(workload: Workload, per_rank: int, rank: int, world: int, seed: int, skip: int = 0) -> Iterator[Batch]:
    """This rank's shard of the data set, ``per_rank`` samples at a time, epoch after epoch,
    starting after the first ``skip`` batches (a resumed run sees the data it would have seen)."""
    if workload.dataset is None:
        raise ValueError(f"workload {workload.name!r} reads a registered dataset: it has no generated data set")
    sampler: DistributedSampler[Batch] = DistributedSampler(
        workload.dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed
    )
    if len(sampler) < per_rank:
        raise ValueError(
            f"each rank's shard has {len(sampler)} samples, fewer than its batch of {per_rank}: "
            "use a smaller batch_size or a larger data set"
        )
    loader = DataLoader(workload.dataset, batch_size=per_rank, sampler=sampler, drop_last=True, collate_fn=as_batch)
    epoch, offset = divmod(skip, len(loader))
    while True:
        sampler.set_epoch(epoch)
        yield from itertools.islice(loader, offset, None)
        epoch, offset = epoch + 1, 0


class Feed:
    """A rank's batches, step after step: the workload's generated data set (``batches``), or the
    registered dataset the spec names (``torchyard.data``: a global order per (seed, epoch), this
    rank's stride of it, read ahead by ``data.workers`` loader processes), resumed at ``position``
    (a checkpoint's; None: derived from the ``done`` steps, as if read from the start)."""

    def __init__(
        self,
        spec: RunSpec,
        workload: Workload,
        per_rank: int,
        rank: int,
        world: int,
        done: int,
        position: dict[str, Any] | None,
    ) -> None:
        seed, self.loader, self.trace = spec.training.seed, None, None
        self.rank, self.told = rank, set[str]()
        self.skip = spec.data is not None and spec.data.on_bad_shard == "skip"
        if spec.data is None:
            self.batches = batches(workload, per_rank, rank, world, seed, skip=done)
            self.samples = len(workload.dataset or ())
            return
        self.loader = data.Loader(
            Path(os.environ[data.DATASET_DIR_ENV]),
            per_rank,
            rank,
            world,
            seed,
            spec.data.shuffle_buffer,
            spec.data.workers,
            collate=workload.collate,
            decode=False,  # the workload's collate decodes the fields it reads
            on_bad_shard=spec.data.on_bad_shard,
        )
        self.tell_bad()
        if position is not None:
            self.loader.load_state_dict(position)
        elif done:
            per_epoch = data.steps_left(self.loader.samples, 0, self.loader.global_batch)
            epoch, steps = divmod(done, per_epoch)
            self.loader.position = data.Position(epoch, steps * self.loader.global_batch)
        self.samples = self.loader.samples
        self.batches = self.loader.forever()
        if trace := os.environ.get("TORCHYARD_DATA_TRACE"):  # tests: every step's sample numbers, per rank
            self.trace = open(Path(trace) / f"rank-{rank}.txt", "a")  # noqa: SIM115 (closed by close())

    def next(self, step: int) -> Batch:
        batch = next(self.batches)
        if self.loader is None:
            return batch
        if len(self.loader.bad) > len(self.told):
            self.tell_bad()
        *tensors, numbers = batch
        if self.trace is not None:
            self.trace.write(f"{step} {' '.join(map(str, numbers.tolist()))}\n")
            self.trace.flush()
        return tuple(tensors)

    def read_counts(self) -> dict[str, float]:
        """What the last batch read from the dataset's shards, as counts StepLog makes rates of (per
        second of the step): field bytes and samples (fewer than the batch when some were skipped)."""
        if self.loader is None:
            return {}
        samples, nbytes = self.loader.last_read
        return {"read_bytes_per_s": float(nbytes), "read_samples_per_s": float(samples)}

    def bad_figures(self) -> dict[str, float]:
        """on_bad_shard "skip": the shards this rank found bad so far, and the samples it could not read."""
        if self.loader is None or not self.skip:
            return {}
        return {"bad_shards": float(len(self.loader.bad)), "bad_samples": float(self.loader.bad_samples)}

    def tell_bad(self) -> None:
        """One line in the run's log for each shard this rank skips, the first time."""
        assert self.loader is not None
        for shard, why in self.loader.bad.items():
            if shard not in self.told:
                self.told.add(shard)
                say(f"rank {self.rank}: skipping bad shard {shard} (data.on_bad_shard 'skip'): {why}")

    def position(self) -> dict[str, Any] | None:
        """The data position after the batches taken so far (None: generated data, whose position
        the step count alone gives)."""
        return self.loader.state_dict() if self.loader is not None else None

    def describe(self) -> str:
        if self.loader is None:
            return f"{self.samples:,} samples"
        p = self.loader.position
        return f"dataset {self.loader.reader.name!r} ({self.samples:,} samples), epoch {p.epoch} at {p.cursor:,}"

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if self.trace is not None:
            self.trace.close()


class CancelVote:
    """Save on cancel, collectively. The SIGTERM reaches the ranks at slightly different times (in
    different steps, on different nodes), yet a save is a collective every rank must enter at the
    same step. So the handler only notes it, and at every step boundary each rank adds its note
    to an all-reduce (MAX) on a Gloo group of its own: every rank reads the same answer, so all stop
    at the same boundary and save together. The all-reduce launched at one boundary is read at the
    next, hidden behind a step's compute (a blocking one would add Gloo's ~2 ms latency to every
    step); a cancel costs at most one step more."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")  # CPU tensors, whatever the training backend
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.work: dist.Work | None = None

    def agreed(self) -> bool:
        """Collective, at each step boundary: True on every rank, at the same step, once any rank
        was cancelled."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            if int(self.flag.item()):
                return True
        self.flag = torch.tensor([int(_cancel["requested"])], dtype=torch.int32)
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return False

    def close(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


def train(spec: RunSpec) -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = spec.resources.device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    world = dist.get_world_size()
    rank = dist.get_rank()

    t = spec.training
    timer = CommTimer(world, device)
    timer.calibration = calibrate(device)
    seed_everything(t.seed)  # before building: every rank starts from the same weights
    workload = build(spec)
    params = sum(p.numel() for p in workload.model.parameters())
    ddp_logging = os.environ.get("TORCHYARD_DDP_LOGGING_CHECK") == "1"  # tests: DDP's own timers, every step
    slow_peer_s = float(os.environ.get("TORCHYARD_SLOW_PEER_S", "0"))  # tests: the last rank late on even steps
    schedule = os.environ.get("TORCHYARD_ASYNC_SCHEDULE_SEED")  # tests: async's updates in a seeded order (a replay)
    strategy = strategies.build(
        spec,
        workload,
        device,
        timer,
        ddp_logging=ddp_logging,
        slow_peer_s=slow_peer_s,
        schedule_seed=None if schedule is None else int(schedule),
    )
    shard, shards = strategy.data_shard(rank, world)
    per_rank = t.batch_size // shards
    checkpoints = checkpoint.directory()
    resume = checkpoint.latest(checkpoints) if checkpoints else None
    done, position = checkpoint.load(resume[1], strategy) if resume else (0, None)
    if resume:
        say(f"rank {rank}/{world}: resumed from the checkpoint at step {done} ({resume[1]})")
    feed = Feed(spec, workload, per_rank, shard, shards, done, position)
    calibration = ", ".join(f"{size >> 10} KB {bw:.2f}" for size, bw in timer.calibration.items())
    say(
        f"rank {rank}/{world}: workload {workload.name}, strategy {strategy.describe()}, device {device}, "
        f"{params:,} parameters, {feed.describe()}, batch {per_rank}/rank, {t.steps} steps"
        + (f"; all-reduce busbw GB/s: {calibration}" if calibration else "")
    )

    print_every = max(1, t.steps // 10)
    step_log = StepLog(timer, torchyard.sdk.log_floats)
    rates = {"samples_per_s": float(per_rank)}
    if workload.tokens_per_sample:
        rates["tokens_per_s"] = float(per_rank * workload.tokens_per_sample)

    def save(root: Path, step: int) -> Path:
        # Every point up to this step is in Redis before the checkpoint exists: a rank killed
        # after it loses only points a resumed attempt logs again.
        step_log.flush()
        if not torchyard.flush(timeout=60):
            say(f"rank {rank}/{world}: metrics up to step {step} not all in Redis yet at the checkpoint")
        return checkpoint.save(root, step, strategy, feed.position())

    vote = CancelVote() if checkpoints and _cancel["save"] else None
    told = rank != 0  # rank 0 tells the attempt's facts once, at its first steady step
    started = time.perf_counter()
    for step in range(done + 1, t.steps + 1):
        logged = step % t.log_every == 0 or step == t.steps
        t0 = time.perf_counter()
        timer.begin_step(step)
        host = feed.next(step)
        timer.batch_ready()
        batch = tuple(x.to(device, non_blocking=True) for x in host)
        timer.data_ready()
        if workload.before_step is not None:
            workload.before_step(step)
        sampled = t.profile_every and step % t.profile_every == 0
        with profiling.capture(cuda) if sampled else contextlib.nullcontext() as prof:
            loss = strategy.train_step(batch)
        if logged:  # step time and loss come with the timer's figures: on CUDA a step later, no sync
            # data_time_s: the timer's
            scalars = {"lr": strategy.lr, **strategy.extra_metrics(), **strategy.memory_figures(), **feed.bad_figures()}
            step_log.hold(step, scalars, per_step={**rates, **feed.read_counts()}, loss=loss)
        step_log.end_step()
        if not told and timer.ops[0] >= done + 2:  # step 1 builds DDP's buckets: count a later one
            told = tell_facts(spec, timer)
        if step % print_every == 0 or step == t.steps:  # a few lines a run: these may wait for the device
            shown = f"loss {float(loss.detach()):.4f}" if loss is not None else "(no loss on this stage)"
            if cuda:
                torch.cuda.synchronize(device)
            say(f"step {step}/{t.steps} {shown} {(time.perf_counter() - t0) * 1e3:.1f} ms/step")
        if prof is not None:
            trace_figures, timeline = profiling.analyze(prof, cuda, step)
            torchyard.log(step, **trace_figures)
            torchyard.sdk.log_timeline(step, timeline)
        saved = None
        final = step == t.steps
        if checkpoints and t.checkpoint_every and (t.checkpoint_final if final else step % t.checkpoint_every == 0):
            saved = save(checkpoints, step)
            if rank == 0:
                say(f"{'final ' if final else ''}checkpoint saved at step {step}: {saved}")
        if vote is not None and checkpoints and step < t.steps and vote.agreed():
            saved = saved or save(checkpoints, step)
            say(f"rank {rank}/{world}: {_stop_reason()}; checkpoint saved at step {step}: {saved}")
            raise SystemExit(128 + signal.SIGTERM)
    if vote is not None:
        vote.close()
    feed.close()
    step_log.flush()
    if not told:  # a run of one or two steps
        tell_facts(spec, timer)
    strategy.close()
    elapsed = time.perf_counter() - started
    ran = t.steps - done
    say(f"rank {rank}/{world}: done, {ran} steps in {elapsed:.1f} s ({ran / max(elapsed, 1e-9):.2f} steps/s)")


def tell_facts(spec: RunSpec, timer: CommTimer) -> bool:
    """Rank 0's word, once per attempt, on how its run ran (``torchyard/facts.py``): what the
    scaling advisor projects from, besides the per-step metrics."""
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", spec.resources.procs_per_node))
    step, ops = timer.ops
    facts = RunFacts(
        world=world,
        nodes=max(1, world // per_node),
        ranks_per_node=per_node,
        cpu_cores=len(os.sched_getaffinity(0)),
        device=spec.resources.device,
        calibration=timer.calibration,
        ops_per_step=ops,  # type: ignore[arg-type]  # kind names, checked by the model
        step=step,
    )
    torchyard.sdk.log_facts(facts.model_dump(mode="json"))
    return True


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Exit, unless this is a cancel of a run that saves on cancel (the launcher marks a cancel
    before its SIGTERM; torch elastic ending the ranks of a crashed gang leaves no mark): then the
    training loop saves at the step boundary the ranks agree on, and exits."""
    marker = os.environ.get("TORCHYARD_CANCEL_MARKER")
    if _cancel["save"] and marker and Path(marker).exists():
        _cancel["requested"] = True
        return
    raise SystemExit(128 + signum)


def _stop_reason() -> str:
    """What the launcher wrote into the cancel marker: "cancelled", or "the worker is stopping"."""
    try:
        return Path(os.environ["TORCHYARD_CANCEL_MARKER"]).read_text().strip()[:100] or "cancelled"
    except (KeyError, OSError):
        return "cancelled"


def main() -> None:
    raw = os.environ.get("TORCHYARD_SPEC")
    if not raw:
        raise SystemExit("TORCHYARD_SPEC is not set: it must hold the run spec as JSON")
    spec = RunSpec.model_validate_json(raw)
    _cancel["save"] = spec.training.checkpoint_on_cancel and spec.strategy.kind in ("ddp", "fsdp")
    # torch elastic stops the other ranks with SIGTERM when one fails (and a cancel does the same):
    # exit through Python, so the metrics already logged are flushed on the way out.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    hangdump.start()  # answers the platform's "why is it stuck" from a thread of its own
    try:
        train(spec)
    finally:
        if not torchyard.flush(float(os.environ.get("TORCHYARD_SDK_EXIT_FLUSH_S", "30"))):
            say("torchyard: some metrics were not written to Redis in time")
    # PowerSGD's future callbacks run on Gloo's worker threads and hold the group in their
    # closures; a worker may release its last callback late (it waits for the GIL). Were that the
    # last reference, ~ProcessGroupGloo would run on that worker and join itself: abort
    # ("Resource deadlock avoided"; seen 1 run in ~36 under load: ~ProcessGroupGloo -> thread::join
    # on its own worker). So the group stays referenced here and the process ends without interpreter
    # teardown, once every metric is in Redis and every line printed.
    world_group = dist.group.WORLD if dist.is_initialized() else None
    if world_group is not None:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    errorfile.install()  # an exception that ends this rank is what the run's failure reason quotes
    main()
