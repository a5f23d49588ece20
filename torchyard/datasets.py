"""The dataset format, in one place: the CLI writes shards with it, the api checks and indexes each
uploaded shard with it and writes the manifest, the ranks read samples with it
(``torchyard/data/``).

A dataset is WebDataset-style tar shards: plain POSIX tar files whose members are named
``KEY.FIELD`` (``0001.input.npy``, ``0001.cls``); consecutive members with the same key are one
sample. Why this format: it needs nothing beyond the standard library (``tarfile``) to write, index
or read; a shard is one file, so it streams to and from any store (local disk, an object store)
whole; ``tar tvf`` and the ``webdataset`` library read it as is. Parquet (``pyarrow``) would add a
~40 MB dependency to the api and the CLI for a columnar layout our samples (arbitrary bytes per
field) do not need.

What makes random access possible without reading a shard through: the api indexes every shard
at upload (``index_shard``) into a small binary ``.idx`` beside it, one fixed record per member
(sample, data offset, size, CRC-32, field). A rank reads one sample with one seek per member and
checks its CRC-32, so a corrupted byte fails the run naming the shard, not silently trains on it.

In its store (``torchyard/stores.py``: a folder ``<dataset root>/<name>/``, or objects
``<prefix>/<name>/`` in an S3-compatible store), written only by the api, read-only for ranks::

    manifest.json          the registry's record for the ranks: shards, sample counts, checksums
    shard-000000.tar       the samples
    shard-000000.idx       its member index (INDEX_RECORD records)
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import struct
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

from torchyard.archive import check_member_name

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"  # a dataset's name: also its folder, so no "/" nor a leading "."
DEFAULT_SHARD_BYTES = 64 * 2**20  # ~64 MB: large enough to stream at disk speed, small enough to spread
MAX_SHARDS = 100_000
MANIFEST = "manifest.json"
DATASET_DIR_ENV = "TORCHYARD_DATASET_DIR"  # where a rank finds the dataset its run's spec names (the worker sets it)
CHUNK = 1 << 20
# One member of a shard: sample number within the shard, data offset, size, CRC-32, field number
# (into the shard's ``fields`` list in the manifest). Little-endian, 32 bytes.
INDEX_RECORD = struct.Struct("<QQQII")
_NPY_MAGIC = b"\x93NUMPY"


class BadShard(ValueError):
    """An uploaded shard that is not a dataset shard (the message names what is wrong)."""


def shard_file(index: int) -> str:
    return f"shard-{index:06d}.tar"


def index_file(index: int) -> str:
    return index_for(shard_file(index))


def index_for(shard: str) -> str:
    """A shard file's index file: ``shard-000003.tar`` -> ``shard-000003.idx``."""
    return shard.removesuffix(".tar") + ".idx"


def checked_name(name: str) -> str:
    """``name``, once it is sure to be one path part (a folder, a key's part)."""
    if not re.match(NAME, name):
        raise ValueError(f"dataset name {name!r} must match {NAME}")
    return name


def dataset_dir(root: Path, name: str) -> Path:
    return root / checked_name(name)


def split_member(name: str) -> tuple[str, str]:
    """``"dir/0001.input.npy"`` -> ``("dir/0001", "input.npy")``: the key is the path up to the
    basename's first dot, the field what follows (WebDataset's convention)."""
    path = PurePosixPath(name)
    stem, dot, fieldname = path.name.partition(".")
    if not stem or not dot or not fieldname:
        raise ValueError(f"member {name!r} is not named KEY.FIELD (e.g. 0001.txt, 0001.cls)")
    return str(path.parent / stem) if str(path.parent) != "." else stem, fieldname


# ---- writing (the CLI) ------------------------------------------------------------------------


def files_as_samples(paths: Iterable[tuple[str, Path]]) -> list[tuple[str, list[tuple[str, Path]]]]:
    """``(relative name, file)`` pairs grouped into samples: [(key, [(field, file), ...])], sorted
    by key and field (what makes a shard's order, and so its bytes, the same for the same files)."""
    members: dict[str, dict[str, Path]] = {}
    for name, path in paths:
        key, fieldname = split_member(name)
        if fieldname in members.setdefault(key, {}):
            raise ValueError(f"two files give sample {key!r} the field {fieldname!r}")
        members[key][fieldname] = path
    return [(key, sorted(members[key].items())) for key in sorted(members)]


class ShardWriter:
    """Writes samples into ``shard-NNNNNN.tar`` files in ``directory``, starting a new shard
    before one would pass ``shard_bytes`` (a sample larger than that gets a shard of its own).
    Deterministic: the same samples give byte-identical shards (fixed times, owners, modes)."""

    def __init__(self, directory: Path, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.directory, self.shard_bytes = directory, shard_bytes
        self.index, self.samples = -1, 0
        self._tar: tarfile.TarFile | None = None

    @property
    def path(self) -> Path:
        return self.directory / shard_file(self.index)

    def add(self, key: str, fields: list[tuple[str, Path]]) -> Path | None:
        """Appends one sample; returns the shard it closed to make room, if any."""
        size = sum(_tar_size(p.stat().st_size) for _, p in fields)
        closed = None
        if self._tar is not None and self.samples and self._tar.offset + size > self.shard_bytes:
            closed = self.close()
        if self._tar is None:
            self.index += 1
            # open across add() calls until the shard is full: close() ends it
            self._tar = tarfile.open(self.path, "w", format=tarfile.PAX_FORMAT)  # noqa: SIM115
            self.samples = 0
        for fieldname, path in fields:
            info = tarfile.TarInfo(f"{key}.{fieldname}")
            info.size, info.mtime, info.mode = path.stat().st_size, 0, 0o644
            with path.open("rb") as f:
                self._tar.addfile(info, f)
        self.samples += 1
        return closed

    def close(self) -> Path | None:
        """Ends the current shard; returns it (None: none was open)."""
        if self._tar is None:
            return None
        self._tar.close()
        self._tar = None
        return self.path


def _tar_size(size: int) -> int:
    return tarfile.BLOCKSIZE + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ---- indexing (the api, at upload) --------------------------------------------------------------


@dataclass
class FieldInfo:
    """What the registry's schema says about one field, over the samples that have it."""

    samples: int = 0
    bytes: int = 0
    npy: dict[str, Any] | None = None  # {"dtype": "<f4", "shape": [32]} when every .npy agrees

    def merge(self, other: FieldInfo) -> None:
        self.npy = _npy_union(self.npy, other.npy, self.samples, other.samples)
        self.samples += other.samples
        self.bytes += other.bytes


def _npy_union(a: dict[str, Any] | None, b: dict[str, Any] | None, a_n: int, b_n: int) -> dict[str, Any] | None:
    if not a_n:
        return b
    if not b_n:
        return a
    return a if a == b else None


@dataclass
class ShardIndex:
    samples: int
    bytes: int
    sha256: str
    index_sha256: str
    fields: list[str]  # the field numbers of the index records
    schema: dict[str, FieldInfo] = field(default_factory=dict)


def index_shard(tar_path: Path, idx_path: Path, sha256: str) -> ShardIndex:
    """Reads every member of an uploaded shard (a plain tar of regular files named KEY.FIELD),
    writes its index to ``idx_path`` and returns what the registry keeps of it. BadShard says what
    is wrong: not a tar, a link or device, a name that is not KEY.FIELD, a field twice in a sample."""
    fields: list[str] = []
    schema: dict[str, FieldInfo] = {}
    samples, last_key, seen = 0, None, set[str]()
    digest = hashlib.sha256()
    try:
        with tarfile.open(tar_path, "r:") as tf, tar_path.open("rb") as raw, idx_path.open("wb") as out:
            for member in tf:
                if member.isdir():
                    continue
                if not member.isfile() or member.issparse():
                    raise BadShard(
                        f"member {member.name!r} is not a regular file (links, devices and sparse files are refused)"
                    )
                try:
                    check_member_name(member.name)  # as a bundle's: never absolute, never climbing with '..'
                    key, fieldname = split_member(member.name)
                except ValueError as exc:  # BadBundle is one
                    raise BadShard(str(exc)) from None
                if key != last_key:
                    samples, last_key, seen = samples + (last_key is not None), key, set()
                if fieldname in seen:
                    raise BadShard(f"sample {key!r} has the field {fieldname!r} twice")
                seen.add(fieldname)
                if fieldname not in schema:
                    schema[fieldname] = FieldInfo()
                    fields.append(fieldname)
                crc, head = _crc_and_head(raw, member.offset_data, member.size)
                info = schema[fieldname]
                info.merge(FieldInfo(1, member.size, _npy_header(head) if fieldname.endswith("npy") else None))
                record = INDEX_RECORD.pack(samples, member.offset_data, member.size, crc, fields.index(fieldname))
                digest.update(record)
                out.write(record)
    except tarfile.TarError as exc:
        raise BadShard(f"not a tar file ({exc})") from None
    samples += last_key is not None
    return ShardIndex(samples, tar_path.stat().st_size, sha256, digest.hexdigest(), fields, schema)


def _crc_and_head(raw: IO[bytes], offset: int, size: int) -> tuple[int, bytes]:
    raw.seek(offset)
    crc, left, head = 0, size, b""
    while left:
        chunk = raw.read(min(CHUNK, left))
        if not chunk:
            raise BadShard(f"the file ends inside a member at byte {offset + size - left}")
        head = head or chunk[:4096]
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc, head


def _npy_header(head: bytes) -> dict[str, Any] | None:
    """dtype and shape from a .npy file's header (NumPy's format, read without NumPy), or None."""
    if not head.startswith(_NPY_MAGIC) or len(head) < 10:
        return None
    major = head[6]
    length, start = (struct.unpack("<H", head[8:10])[0], 10) if major == 1 else (struct.unpack("<I", head[8:12])[0], 12)
    try:
        header = ast.literal_eval(head[start : start + length].decode("latin1"))
        return {"dtype": str(header["descr"]), "shape": list(header["shape"])}
    except (ValueError, SyntaxError, KeyError, TypeError):
        return None


# ---- the manifest (written by the api, read by the ranks) ---------------------------------------


@dataclass
class ShardEntry:
    file: str
    samples: int
    bytes: int
    sha256: str
    index_sha256: str
    fields: list[str]


@dataclass
class Manifest:
    name: str
    digest: str  # the content's identity: sha256 over every shard's sha256, in order
    samples: int
    bytes: int
    shards: list[ShardEntry]
    schema: dict[str, dict[str, Any]]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        data = json.loads((directory / MANIFEST).read_text())
        data["shards"] = [ShardEntry(**s) for s in data["shards"]]
        return cls(**data)


def content_digest(shard_sha256s: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(shard_sha256s).encode()).hexdigest()


def make_manifest(name: str, shards: list[ShardEntry], schemas: list[dict[str, FieldInfo]]) -> Manifest:
    """The manifest of shards 0..n-1 (``schemas``: each one's fields, merged into the dataset's)."""
    merged: dict[str, FieldInfo] = {}
    for schema in schemas:
        for fieldname, info in schema.items():
            merged.setdefault(fieldname, FieldInfo()).merge(info)
    return Manifest(
        name=name,
        digest=content_digest(s.sha256 for s in shards),
        samples=sum(s.samples for s in shards),
        bytes=sum(s.bytes for s in shards),
        shards=shards,
        schema={fieldname: asdict(info) for fieldname, info in sorted(merged.items())},
    )


def write_dataset(
    folder: Path,
    name: str,
    sources: Iterable[Path],
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    samples: Iterable[tuple[str, list[tuple[str, Path]]]] | None = None,
) -> Manifest:
    """A dataset folder written here directly, as the api would store it (shards, indexes,
    manifest), without an api: for tests and benchmarks of the reading side. ``samples``: (key,
    [(field, file), ...]) in order, instead of ``sources``' files (one file may serve many samples:
    a large dataset without as many bytes of files)."""
    folder.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(folder, shard_bytes)
    for key, fields in files_as_samples(iter_files(sources)) if samples is None else samples:
        writer.add(key, fields)
    writer.close()
    entries, schemas = [], []
    for index in range(writer.index + 1):
        path = folder / shard_file(index)
        indexed = index_shard(path, folder / index_file(index), sha256_file(path))
        entries.append(
            ShardEntry(path.name, indexed.samples, indexed.bytes, indexed.sha256, indexed.index_sha256, indexed.fields)
        )
        schemas.append(indexed.schema)
    manifest = make_manifest(name, entries, schemas)
    write_public(folder / MANIFEST, manifest.to_json())
    return manifest


def write_public(path: Path, data: bytes | str) -> None:
    """A dataset file the ranks (another user, through a read-only bind) must be able to read."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def iter_files(sources: Iterable[Path]) -> Iterator[tuple[str, Path]]:
    """(relative name, file) for what ``dataset create --from`` names: every file under a folder
    (named relative to it; hidden files and folders left out), or a file by its own name."""
    for source in sources:
        if source.is_dir():
            for base, dirs, names in os.walk(source):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if not name.startswith("."):
                        path = Path(base, name)
                        yield path.relative_to(source).as_posix(), path
        else:
            yield source.name, source
