"""A dataset's files as a rank reads them (``torchyard/data/``): in a folder (the dataset's own,
bound read-only), or in an object store through the view the worker wrote (``torchyard/stores.py``:
the manifest, and ``objects.json``: each file's presigned GET URL and size), whichever the folder
``open_files`` is given holds.

From an object store a loader process reads a batch at once: the byte ranges of its samples
(from the shards' indexes) are fetched together before they are taken one by one, as concurrent
ranged GETs (CONCURRENT in flight), ranges less than GAP apart merged into one GET (samples in
stored order come in one GET per shard and batch). A store's latency is then paid once per batch,
not per sample, and no byte is fetched that the batch does not need (but the gaps). So a loader
process holds the bytes of the batch it is reading, never a shard, never the dataset. What fails
as in a folder: an object not there (listed so, or a 404) is a missing file; a short one fails the
field's size check, a changed byte its CRC-32, a changed index its sha256 (``data/shards.py``). Anything
else the store answers (403: the URL expired, or 5xx and lost connections after TRIES tries) is a
StoreError: the run fails, never skips a shard (a store that is down is no bad shard)."""

from __future__ import annotations

import bisect
import contextlib
import errno
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

if TYPE_CHECKING:
    import httpx  # imported where a store is read: every rank imports this module, few read over HTTP

OBJECTS = "objects.json"  # the view's listing (``torchyard/stores.py`` writes it)
CONCURRENT = 16  # GETs in flight at once, per reading process
GAP = 64 * 1024  # ranges closer than this come in one GET: the bytes between cost less than a request
TRIES = 3
TIMEOUT_S, READ_TIMEOUT_S = 30, 120


class StoreError(OSError):
    """The object store answered what is not a bad shard: the run fails with it."""


class Handle(Protocol):
    def seek(self, offset: int, /) -> int: ...
    def read(self, size: int, /) -> bytes: ...
    def close(self) -> None: ...


class Folder:
    """The files of a dataset in a folder."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def where(self, file: str) -> str:
        return str(self.directory / file)

    def size(self, file: str) -> int:
        return (self.directory / file).stat().st_size

    def open(self, file: str) -> BinaryIO:
        return (self.directory / file).open("rb")

    def read(self, file: str) -> bytes:
        return (self.directory / file).read_bytes()


class Objects:
    """The files of a dataset in an object store, through a view's presigned URLs."""

    def __init__(self, listing: dict[str, dict[str, Any]]) -> None:
        self.listing = listing
        self._fetched: dict[str, list[tuple[int, bytes]]] = {}  # file -> (start, bytes) of the last fetch
        self._http: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0

    def where(self, file: str) -> str:
        entry = self.listing.get(file)
        return str(entry["url"]).split("?", 1)[0] if entry else file  # the URL without its signature

    def size(self, file: str) -> int:
        entry = self.listing.get(file)
        if entry is None or entry["bytes"] is None:
            raise FileNotFoundError(errno.ENOENT, "not in the object store", self.where(file))
        return int(entry["bytes"])

    def open(self, file: str) -> _Ranged:
        return _Ranged(self, file, self.size(file))

    def read(self, file: str) -> bytes:
        return self._get(file, 0, self.size(file))

    def fetch(self, wanted: dict[str, list[tuple[int, int]]]) -> None:
        """Fetches the byte ranges ``wanted`` (file -> [(start, end)]) for the reads that follow, in
        place of what the last fetch held. A range that fails is left out: its read GETs it again
        and says why (a missing object, a store that refuses)."""
        ranges = [(file, start, end) for file, spans in wanted.items() for start, end in _merged(spans)]
        self._client()
        assert self._pool is not None
        futures = [(r, self._pool.submit(self._get, *r)) for r in ranges]
        self._fetched = {}
        for (file, start, _end), future in futures:
            with contextlib.suppress(OSError):
                self._fetched.setdefault(file, []).append((start, future.result()))
        for spans in self._fetched.values():
            spans.sort(key=lambda span: span[0])

    def read_at(self, file: str, offset: int, size: int) -> bytes:
        spans = self._fetched.get(file, [])
        at = bisect.bisect_right(spans, offset, key=lambda span: span[0]) - 1
        if at >= 0:
            start, data = spans[at]
            if offset + size <= start + len(data):
                return data[offset - start : offset - start + size]
        return self._get(file, offset, offset + size)

    def _client(self) -> httpx.Client:
        if self._pid != os.getpid():  # a forked loader process: a client (and connections) of its own
            import httpx

            limits = httpx.Limits(max_connections=CONCURRENT, max_keepalive_connections=CONCURRENT)
            timeout = httpx.Timeout(TIMEOUT_S, read=READ_TIMEOUT_S)
            self._http, self._pid = httpx.Client(timeout=timeout, limits=limits), os.getpid()
            self._pool = ThreadPoolExecutor(CONCURRENT, thread_name_prefix="torchyard-get")
        assert self._http is not None
        return self._http

    def _get(self, file: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of ``file`` (fewer where the object is shorter)."""
        if end <= start:
            return b""
        import httpx

        url, headers = self.listing[file]["url"], {"Range": f"bytes={start}-{end - 1}"}
        for attempt in range(TRIES):
            try:
                response = self._client().get(url, headers=headers)
            except httpx.TransportError as exc:
                if attempt + 1 == TRIES:
                    raise StoreError(f"reading {self.where(file)} from the object store failed: {exc!r}") from None
                time.sleep(0.5 * 2**attempt)
                continue
            if response.status_code == 206:
                return response.content
            if response.status_code == 200:  # a store that ignores Range: the whole object came
                return response.content[start:end]
            if response.status_code == 416:  # the object is shorter than start
                return b""
            if response.status_code == 404:
                raise FileNotFoundError(errno.ENOENT, "not in the object store", self.where(file))
            if response.status_code < 500 or attempt + 1 == TRIES:
                expired = (
                    " (a rank's presigned URLs last TORCHYARD_DATASET_URL_TTL_S: the run's next attempt gets new ones)"
                )
                raise StoreError(
                    f"reading {self.where(file)} from the object store: {response.status_code} {response.text[:300]}"
                    + (expired if response.status_code == 403 else "")
                )
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges sorted, those less than GAP apart made one."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start - out[-1][1] < GAP:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class _Ranged:
    """One object as a seekable file: what ``data.ShardReader`` seeks and reads in a local one."""

    def __init__(self, objects: Objects, file: str, size: int) -> None:
        self.objects, self.file, self.size, self.at = objects, file, size, 0

    def seek(self, offset: int, /) -> int:
        self.at = offset
        return offset

    def read(self, size: int, /) -> bytes:
        data = self.objects.read_at(self.file, self.at, max(0, min(size, self.size - self.at)))
        self.at += len(data)
        return data

    def close(self) -> None:
        pass  # its bytes are the last fetch's (Objects), its connections the client's


def open_files(directory: Path) -> Folder | Objects:
    """The files of the dataset in ``directory``: its own folder, or a view of one in an object store."""
    try:
        listing = json.loads((directory / OBJECTS).read_text())
    except FileNotFoundError:
        return Folder(directory)
    return Objects(listing)
