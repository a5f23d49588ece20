"""A rank's loader: this rank's share of each step in the global order, read and decoded ahead in
loader processes, bad shards failed or skipped alike on every rank, its position saved and resumed;
and :func:`loader`, the one call a script makes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from torchyard import datasets as fmt
from torchyard import shardfiles
from torchyard.data.order import Order, Position, rank_positions, steps_left
from torchyard.data.shards import Sample, ShardError, ShardReader


@dataclass
class _Read:
    """What a loader process hands the rank for one step: the batch (None: not one of its samples
    could be read), how many samples and field bytes it read, and each sample it left out (its
    shard, why)."""

    batch: Any
    samples: int
    bytes: int
    skipped: list[tuple[str, str]]


class _Samples(Dataset[Any]):
    """A DataLoader's map-style view: a batch of global numbers → ``collate`` of those samples, made
    in the loader process that reads them. ``skip``: unreadable samples are left out and the
    readable ones of the batch repeated in their place, so the batch keeps its size (a model's
    shapes, a loss's mean) and every rank still takes every step."""

    def __init__(self, reader: ShardReader, collate: Callable[[list[Sample]], Any], decode: bool, skip: bool) -> None:
        self.reader, self.collate, self.decode, self.skip = reader, collate, decode, skip

    def __len__(self) -> int:
        return int(self.reader.starts[-1])

    def __getitem__(self, index: int) -> _Read:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> _Read:
        before, skipped = self.reader.bytes_read, list[tuple[str, str]]()
        samples = self.reader.read(indices, self.decode, skipped if self.skip else None)
        read = len(samples)
        if samples and read < len(indices):
            samples = [samples[i % read] for i in range(len(indices))]
        batch = self.collate(samples) if samples else None
        return _Read(batch, read, self.reader.bytes_read - before, skipped)


def _as_list(samples: list[Sample]) -> list[Sample]:
    return samples


def _passthrough(batch: Any) -> Any:
    return batch  # __getitems__ made the batch already


# ---- the loader -------------------------------------------------------------------------------


def _left_out_everywhere(found: dict[str, str], reader: ShardReader) -> dict[str, str]:
    """The shards any rank found bad, left out on every rank (a collective on the default group):
    a shard lost between two ranks' checks would give them other orders and step counts, a hang."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    union = {file: why for each in gathered for file, why in sorted(each.items())}
    reader.leave_out(union)
    return union


class Loader:
    """This rank's batches of a dataset, one epoch per ``iter()``, resumable exactly (see the module)."""

    def __init__(
        self,
        directory: Path,
        batch_size: int,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 10_000,
        workers: int = 2,
        collate: Callable[[list[Sample]], Any] | None = None,
        decode: bool = True,
        prefetch_factor: int = 2,
        on_bad_shard: str = "fail",
    ) -> None:
        if batch_size < 1 or not 0 <= rank < world:
            raise ValueError(f"batch_size ({batch_size}) must be ≥ 1 and rank ({rank}) in [0, world ({world}))")
        if on_bad_shard not in ("fail", "skip"):
            raise ValueError(f"on_bad_shard ({on_bad_shard!r}) must be 'fail' or 'skip'")
        skip = on_bad_shard == "skip"
        self.reader = ShardReader(directory)
        # What this rank found wrong (skip): shard file -> why (the first time), and how many samples
        # it could not read. Shards left out here, at the start, are not read at all.
        self.bad = self.reader.check_files(skip)
        if skip and world > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world:
            self.bad = _left_out_everywhere(self.bad, self.reader)
        self.left_out = sorted(self.bad)  # of the order (shards found bad while reading lose samples, not a place)
        self.bad_samples = 0
        self.last_read = (0, 0)  # samples and field bytes read for the batch handed out last
        self._last_batch: Any = None
        self.batch_size, self.rank, self.world = batch_size, rank, world
        self.seed, self.shuffle_buffer, self.workers = seed, shuffle_buffer, workers
        self.prefetch_factor = prefetch_factor
        self.samples = sum(self.reader.counts)
        if self.samples < self.global_batch:
            raise ValueError(
                f"dataset {self.reader.name!r} has {self.samples:,} samples"
                + (
                    f" in its readable shards ({len(self.bad)} left out: {'; '.join(self.bad.values())})"
                    if self.bad
                    else ""
                )
                + f", fewer than one global batch ({batch_size} per rank × {world} ranks): not one step fits in an epoch"
            )
        self.position = Position()
        self._dataset = _Samples(self.reader, collate or _as_list, decode, skip)
        self._epoch_iter: _Epoch | None = None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world

    def __len__(self) -> int:
        """Steps left in the current epoch."""
        return steps_left(self.samples, self.position.cursor, self.global_batch)

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch (all of it for a new one); the next ``iter()`` starts the next."""
        self.close()
        if not len(self):  # an epoch already consumed (a resume at its very end): the next one
            self.position = Position(self.position.epoch + 1, 0)
        self._epoch_iter = _Epoch(self)
        return self._epoch_iter

    def state_dict(self) -> dict[str, Any]:
        """The data position after the batches handed out so far, with what defines the order."""
        return {
            **asdict(self.position),
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            "samples": self.samples,
            "digest": self.reader.manifest.digest,
            "dataset": self.reader.name,
            "left_out": self.left_out,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was saved: the same order (its seed and shuffle), the next
        unseen sample, whatever this attempt's world size."""
        if state.get("digest") != self.reader.manifest.digest:
            raise ValueError(
                f"the saved data position is of dataset {state.get('dataset')!r} (content {str(state.get('digest'))[:12]}), "
                f"not of {self.reader.name!r} as it is now (content {self.reader.manifest.digest[:12]}): "
                "resuming would not continue its order"
            )
        if "left_out" in state and sorted(state["left_out"]) != self.left_out:
            raise ValueError(
                f"the saved data position of dataset {self.reader.name!r} was taken with shards "
                f"{sorted(state['left_out']) or 'none'} left out (on_bad_shard: skip), and now "
                f"{self.left_out or 'none'} are: the epoch's order is another one, resuming would not continue it"
            )
        self.close()
        self.seed, self.shuffle_buffer = int(state["seed"]), int(state["shuffle_buffer"])
        self.position = Position(int(state["epoch"]), int(state["cursor"]))

    def close(self) -> None:
        """Ends the current epoch's loader processes (they also end with this process)."""
        if self._epoch_iter is not None:
            self._epoch_iter.close()
            self._epoch_iter = None

    def _took(self, read: _Read) -> Any:
        """The batch a loader process read, its figures counted; a batch with not one readable
        sample is the last good one again (the rank must still take the step)."""
        for shard, why in read.skipped:
            self.bad.setdefault(shard, why)
        self.bad_samples += len(read.skipped)
        self.last_read = (read.samples, read.bytes)
        if read.batch is not None:
            self._last_batch = read.batch
        elif self._last_batch is None:
            raise ShardError(
                f"dataset {self.reader.name!r}: not one sample of this rank's first batch could be read "
                f"({read.skipped[0][1]}), and there is no batch before it to take its place"
            )
        return self._last_batch

    def forever(self) -> Iterator[Any]:
        """Epoch after epoch (the built-in workloads train for a number of steps)."""
        while True:
            yield from self


class _Epoch(Iterator[Any]):
    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        start = loader.position
        reader = loader.reader
        order = Order(reader.counts, loader.seed, start.epoch, loader.shuffle_buffer, reader.starts[:-1])
        steps = len(loader)
        batch, rank, world = loader.batch_size, loader.rank, loader.world

        def plan() -> Iterator[list[int]]:  # in the rank's own process: which samples, step by step
            for step in range(steps):
                yield order.sample_at(rank_positions(start.cursor, step, batch, rank, world)).tolist()

        kwargs: dict[str, Any] = {}
        if loader.workers:
            kwargs = {"prefetch_factor": loader.prefetch_factor, "persistent_workers": False}
        self.batches: Iterator[Any] | None = iter(
            DataLoader(
                loader._dataset,
                batch_sampler=plan(),  # type: ignore[arg-type]
                collate_fn=_passthrough,
                num_workers=loader.workers,
                **kwargs,
            )
        )

    def __next__(self) -> Any:
        if self.batches is None:
            raise StopIteration
        try:
            batch = next(self.batches)
        except StopIteration:
            self.loader.position = Position(self.loader.position.epoch + 1, 0)
            self.close()
            raise
        except (ShardError, shardfiles.StoreError) as exc:
            self.close()  # its loader processes end now, not whenever the iterator is collected
            raise _unwrapped(exc) from exc
        position = self.loader.position
        self.loader.position = Position(position.epoch, position.cursor + self.loader.global_batch)
        return self.loader._took(batch)

    def close(self) -> None:
        batches, self.batches = getattr(self, "batches", None), None
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def _unwrapped(exc: OSError) -> OSError:
    """DataLoader re-raises a loader process's exception with that process's traceback in its
    message; the rank's failure reason says the original message alone (it names the shard)."""
    text = str(exc)
    if "Original Traceback" not in text:
        return exc
    return type(exc)(text.rstrip().splitlines()[-1].split(": ", 1)[-1])


# ---- for a script -----------------------------------------------------------------------------


DATASET_DIR_ENV = fmt.DATASET_DIR_ENV


def loader(
    batch_size: int,
    dataset: str | Path | None = None,
    collate: Callable[[list[Sample]], Any] | None = None,
    shuffle_buffer: int | None = None,
    workers: int | None = None,
    seed: int | None = None,
    rank: int | None = None,
    world: int | None = None,
    decode: bool = True,
    on_bad_shard: str | None = None,
) -> Loader:
    """This rank's loader of the run's dataset, ``batch_size`` samples per step on each rank.

    Everything but ``batch_size`` defaults to the run: the dataset the spec's ``data.dataset``
    names (or ``dataset``: the folder of one, for use outside the platform), its ``shuffle_buffer``
    and ``workers``, ``training.seed``, and the rank and world size of torch.distributed (else
    RANK / WORLD_SIZE, else 0 of 1), its ``on_bad_shard``. ``collate`` turns a list of samples into a batch, in the loader
    process (default: the list itself)."""
    spec = json.loads(os.environ.get("TORCHYARD_SPEC") or "{}")
    data = spec.get("data") or {}
    if dataset is None:
        if not os.environ.get(DATASET_DIR_ENV):
            raise ValueError(
                'torchyard.data.loader: which dataset? Name one in the run spec ("data": {"dataset": NAME}) '
                "or pass dataset=FOLDER"
            )
        dataset = os.environ[DATASET_DIR_ENV]
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return Loader(
        Path(dataset),
        batch_size,
        rank=rank if rank is not None else torch.distributed.get_rank() if distributed else _env("RANK", 0),
        world=world
        if world is not None
        else torch.distributed.get_world_size()
        if distributed
        else _env("WORLD_SIZE", 1),
        seed=seed if seed is not None else int((spec.get("training") or {}).get("seed", 0)),
        shuffle_buffer=shuffle_buffer if shuffle_buffer is not None else int(data.get("shuffle_buffer", 10_000)),
        workers=workers if workers is not None else int(data.get("workers", 2)),
        collate=collate,
        decode=decode,
        on_bad_shard=on_bad_shard or str(data.get("on_bad_shard", "fail")),
    )


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))
