"""Reading a registered dataset inside the ranks: the built-in workloads read it with this, and a
script with the tiny helper :func:`loader`::

    from torchyard import data

    batches = data.loader(batch_size=32)         # the run spec's data.dataset, this rank's share
    if saved:                                    # your checkpoint: batches.state_dict() at its step
        batches.load_state_dict(saved["data"])
    for epoch in range(epochs):
        for batch in batches:                    # one epoch, from where the state left off
            ...                                  # batch: a list of samples (dicts), or collate's
        save({"data": batches.state_dict(), ...})

Each sample is a dict of its fields, decoded by extension (``.npy`` → numpy array, ``.cls`` →
int, ``.txt`` → str, ``.json`` → object, ``.pt``/``.pth`` → torch.load(weights_only), else bytes)
plus ``__index__`` (its global number) and ``__shard__`` (the shard file it came from).

**The order is global.** Epoch ``e`` of seed ``s`` puts the samples in one order: the shards in a
random order, then each window of ``shuffle_buffer`` positions shuffled (both drawn from (s, e)
alone; ``shuffle_buffer`` 0: the stored order). Rank ``r`` of ``W`` takes positions ``r, r+W,
r+2W, ...``: each step the ranks together take the next ``batch × W`` positions, so every rank has
the same number of steps per epoch (``(samples − cursor) // (batch × W)``, known from the registry's
sample count, whatever the shards' sizes: uneven shards never hang DDP), and the few positions left
at an epoch's end are skipped that epoch. Every sample of an epoch is read at most once, by one rank
and one loader process; a rank reads only its own samples, one seek per field into the shard (the
shard's index says where; every field's CRC-32 is checked: a corrupted shard fails the run naming
it). From an object store, a batch's samples are fetched together first (``torchyard/shardfiles.py``).

**A bad shard** (missing, truncated, failing a checksum) fails the run naming it, or, with
``on_bad_shard="skip"``, is skipped and counted: a shard found missing or of the wrong size at the
start by any rank is left out of the epoch's order on every rank (they agree on it: building the
loader is then a collective, on every rank); a sample found unreadable while reading is left out
of its batch and the batch's readable samples repeated in its place (the batch keeps its size,
every rank every step). ``Loader.bad`` says which shards were found bad (``left_out``: those left
out of the order), ``bad_samples`` how many samples this rank could not read. A resume with other shards left out than the saved position's
is refused: the order would be another.

**The data position is global too**: (epoch, cursor), the cursor being how many positions of the
epoch's order the ranks together have consumed. Saved with a checkpoint, it resumes the epoch with
the next unseen sample on any world size: the same order, a new stride.

Loader processes (``workers``) read and decode ahead (torch's DataLoader, ``prefetch_factor``
batches each); the rank's own process only computes which samples come next."""

from __future__ import annotations

import hashlib
import io
import json
import os
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from torchyard import datasets as fmt
from torchyard import shardfiles

Sample = dict[str, Any]
_RECORD = np.dtype([("sample", "<u8"), ("offset", "<u8"), ("size", "<u8"), ("crc", "<u4"), ("field", "<u4")])
assert _RECORD.itemsize == fmt.INDEX_RECORD.size
OPEN_SHARDS = 16  # file handles (and indexes) a reading process keeps
WINDOWS_KEPT = 8  # shuffled windows a process keeps computed


class ShardError(OSError):
    """A shard that cannot be read as the manifest says: missing, truncated or corrupt. Its message
    names the dataset and the shard."""


# ---- the order of an epoch --------------------------------------------------------------------


class Order:
    """Epoch ``epoch``'s order of a dataset whose shards hold ``counts`` samples: which global
    sample is at each position. Needs O(shards + shuffle_buffer) memory, never O(samples).
    ``starts``: each shard's first global number, when not the sums of ``counts`` (a shard left
    out has a count of 0 and the others keep their numbers)."""

    def __init__(
        self, counts: list[int], seed: int, epoch: int, shuffle_buffer: int, starts: np.ndarray | None = None
    ) -> None:
        self.seed, self.epoch, self.window = seed, epoch, shuffle_buffer
        sizes = np.asarray(counts, dtype=np.int64)
        self.samples = int(sizes.sum())
        # shard -> its first sample
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if starts is None else starts
        shuffled = shuffle_buffer > 0
        self.shards = (
            np.random.default_rng([seed, epoch]).permutation(len(counts)) if shuffled else np.arange(len(counts))
        )
        self.offsets = np.concatenate([[0], np.cumsum(sizes[self.shards])]).astype(np.int64)  # in shard order
        self._windows: OrderedDict[int, np.ndarray] = OrderedDict()

    def sample_at(self, positions: np.ndarray) -> np.ndarray:
        """The global sample numbers at ``positions`` (each in [0, samples))."""
        positions = np.asarray(positions, dtype=np.int64)
        placed = positions.copy()
        if self.window > 1:
            for w in np.unique(positions // self.window):
                mask = positions // self.window == w
                base = int(w) * self.window
                placed[mask] = base + self._window(int(w))[positions[mask] - base]
        k = np.searchsorted(self.offsets, placed, side="right") - 1
        return self.starts[self.shards[k]] + (placed - self.offsets[k])

    def _window(self, w: int) -> np.ndarray:
        if w not in self._windows:
            size = min(self.window, self.samples - w * self.window)
            self._windows[w] = np.random.default_rng([self.seed, self.epoch, w, 1]).permutation(size)
            while len(self._windows) > WINDOWS_KEPT:
                self._windows.popitem(last=False)
        self._windows.move_to_end(w)
        return self._windows[w]


@dataclass
class Position:
    """Where reading stands: epoch, and the positions of its order the ranks together consumed."""

    epoch: int = 0
    cursor: int = 0


def steps_left(samples: int, cursor: int, global_batch: int) -> int:
    """Steps the ranks all take in the rest of an epoch (the tail that fills no global batch is skipped)."""
    return max(0, (samples - cursor) // global_batch)


def rank_positions(cursor: int, step: int, batch: int, rank: int, world: int) -> np.ndarray:
    """The positions rank ``rank`` of ``world`` reads in the ``step``-th step after ``cursor``."""
    first = cursor + step * batch * world + rank
    return first + world * np.arange(batch, dtype=np.int64)


# ---- reading samples --------------------------------------------------------------------------


class ShardReader:
    """Random access to a dataset's samples, by global number. Opens what it needs lazily, so each
    loader process (forked after it was made) opens its own files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        try:
            self.manifest = fmt.Manifest.read(directory)
        except FileNotFoundError:
            raise ShardError(
                f"no dataset at {directory} (its {fmt.MANIFEST} is missing): the worker reads datasets from "
                "TORCHYARD_DATASET_ROOT, which must be the api's (shared storage on several hosts)"
            ) from None
        self.files = shardfiles.open_files(directory)  # the dataset's folder, or a view of an object store's
        self.counts = [s.samples for s in self.manifest.shards]  # 0 for a shard left out (check_files)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)  # global numbers: the manifest's
        self._open: OrderedDict[int, tuple[shardfiles.Handle, np.ndarray]] = OrderedDict()
        self._broken: dict[int, ShardError] = {}  # shards this process could not open: not tried again
        self._pid = os.getpid()
        self.bytes_read = 0  # field bytes this process read (each loader process counts its own)

    @property
    def name(self) -> str:
        return self.manifest.name

    def check_files(self, skip: bool = False) -> dict[str, str]:
        """Every shard is there with its size (cheap: one stat each), or a ShardError naming the first
        that is not. ``skip``: such shards are left out instead (as if they held no samples; the
        loader then leaves out on every rank what any rank found, so all keep one order and one
        number of steps); returns them, file -> what is wrong."""
        left_out: dict[str, str] = {}
        for entry in self.manifest.shards:
            try:
                size = self.files.size(entry.file)
                problem = (
                    None
                    if size == entry.bytes
                    else f"dataset {self.name!r}: shard {entry.file} is corrupt: {size:,} bytes, the manifest says "
                    f"{entry.bytes:,}"
                )
            except FileNotFoundError:
                problem = f"dataset {self.name!r}: shard {entry.file} is missing ({self.files.where(entry.file)})"
            if problem is None:
                continue
            if not skip:
                raise ShardError(problem)
            left_out[entry.file] = problem
        self.leave_out(left_out)
        return left_out

    def leave_out(self, files: Iterable[str]) -> None:
        """These shards hold no samples from now on: the epoch's order goes without them."""
        gone = set(files)
        for shard, entry in enumerate(self.manifest.shards):
            if entry.file in gone:
                self.counts[shard] = 0

    def read(
        self, indices: list[int], decode: bool = True, skipped: list[tuple[str, str]] | None = None
    ) -> list[Sample]:
        """The samples ``indices`` (global numbers), in that order; read shard by shard, in file order.
        ``skipped``: a sample that cannot be read is left out (the list is shorter) and (its shard,
        why) appended there, instead of a ShardError."""
        if os.getpid() != self._pid:  # a forked loader process: never share the parent's file offsets
            self._open.clear()
            self._pid = os.getpid()
        shards = np.searchsorted(self.starts, indices, side="right") - 1
        if isinstance(self.files, shardfiles.Objects):
            self._fetch(shards, indices)
        out: list[Sample | None] = [None] * len(indices)
        for at in np.lexsort((np.asarray(indices), shards)):
            shard, index = int(shards[at]), int(indices[at])
            try:
                out[at] = self._sample(shard, index - int(self.starts[shard]), index, decode)
            except ShardError as exc:
                if skipped is None:
                    raise
                skipped.append((self.manifest.shards[shard].file, str(exc)))
        return [sample for sample in out if sample is not None]

    def _fetch(self, shards: np.ndarray, indices: list[int]) -> None:
        """From an object store: the bytes of these samples fetched together, before they are read."""
        assert isinstance(self.files, shardfiles.Objects)
        wanted: dict[str, list[tuple[int, int]]] = {}
        for shard, index in zip(shards.tolist(), indices, strict=True):
            try:
                _, records = self._shard(shard)
            except ShardError:
                continue  # reading it fails (or skips it) and says why
            local = index - int(self.starts[shard])
            lo, hi = np.searchsorted(records["sample"], [local, local + 1])
            if hi > lo:
                fields = records[lo:hi]
                span = int(fields["offset"].min()), int((fields["offset"] + fields["size"]).max())
                wanted.setdefault(self.manifest.shards[shard].file, []).append(span)
        self.files.fetch(wanted)

    def _sample(self, shard: int, local: int, index: int, decode: bool) -> Sample:
        entry = self.manifest.shards[shard]
        handle, records = self._shard(shard)
        lo, hi = np.searchsorted(records["sample"], [local, local + 1])
        sample: Sample = {"__index__": index, "__shard__": entry.file}
        for record in records[lo:hi]:
            handle.seek(int(record["offset"]))
            try:
                data = handle.read(int(record["size"]))
            except FileNotFoundError:  # an object gone since the view listed it (a local file stays readable)
                raise ShardError(
                    f"dataset {self.name!r}: shard {entry.file} is missing ({self.files.where(entry.file)})"
                ) from None
            self.bytes_read += len(data)
            name = entry.fields[int(record["field"])]
            if len(data) != int(record["size"]) or zlib.crc32(data) != int(record["crc"]):
                raise ShardError(
                    f"dataset {self.name!r}: shard {entry.file} is corrupt: sample {local} field {name!r} at byte "
                    f"{int(record['offset']):,} fails its CRC-32 check"
                )
            sample[name] = decode_field(name, data) if decode else data
        return sample

    def _shard(self, shard: int) -> tuple[shardfiles.Handle, np.ndarray]:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        if shard in self._broken:
            raise self._broken[shard]
        entry = self.manifest.shards[shard]
        try:
            handle = self.files.open(entry.file)
            raw = self.files.read(fmt.index_for(entry.file))
        except FileNotFoundError as exc:
            error = ShardError(f"dataset {self.name!r}: shard {entry.file} is missing ({exc.filename})")
            self._broken[shard] = error
            raise error from None
        if hashlib.sha256(raw).hexdigest() != entry.index_sha256:
            handle.close()
            error = ShardError(
                f"dataset {self.name!r}: shard {entry.file} is corrupt: its index fails its sha256 check"
            )
            self._broken[shard] = error
            raise error
        self._open[shard] = (handle, np.frombuffer(raw, dtype=_RECORD))
        while len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)[1][0].close()
        return self._open[shard]


def decode_field(name: str, data: bytes) -> Any:
    """A field's bytes as its extension says (the last one: ``input.npy`` is a .npy)."""
    ext = name.rsplit(".", 1)[-1]
    if ext == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    if ext in ("cls", "cls2", "index", "id"):
        return int(data)
    if ext in ("txt", "text"):
        return data.decode("utf-8")
    if ext == "json":
        return json.loads(data)
    if ext in ("pt", "pth"):
        return torch.load(io.BytesIO(data), weights_only=True)
    return data


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
