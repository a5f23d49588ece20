"""Random access to a dataset's samples by global number: each field one seek into its shard, its
CRC-32 checked, decoded by its extension."""

from __future__ import annotations

import hashlib
import io
import json
import os
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchyard import datasets as fmt
from torchyard import shardfiles

Sample = dict[str, Any]
_RECORD = np.dtype([("sample", "<u8"), ("offset", "<u8"), ("size", "<u8"), ("crc", "<u4"), ("field", "<u4")])
assert _RECORD.itemsize == fmt.INDEX_RECORD.size
OPEN_SHARDS = 16  # file handles (and indexes) a reading process keeps


class ShardError(OSError):
    """A shard that cannot be read as the manifest says: missing, truncated or corrupt. Its message
    names the dataset and the shard."""


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
