"""Where datasets' files live (their format: ``torchyard/datasets.py``): a folder,
``TORCHYARD_DATASET_ROOT/<name>/``, or an S3-compatible object store (AWS S3, MinIO, ...),
``TORCHYARD_DATASET_STORE=s3://BUCKET/PREFIX`` holding ``PREFIX/<name>/<file>``. The api writes
through a store (``backend/datasets.py``); a worker checks that a run's dataset is there and gives
its ranks a way in (:meth:`give`); the ranks read with ``torchyard/data/``.

The trust wall (ARCHITECTURE.md): ranks run a member's code, so they never hold the store's
credentials, which write and delete every dataset. A folder reaches them through a read-only bind
(``workers/isolation.py``). An object store reaches them as a *view* the worker writes into the
attempt's run directory: the manifest, and ``objects.json`` with each file of that one dataset's
presigned GET URL and size (``torchyard/shardfiles.py`` reads them). A presigned URL lets its
holder GET one object until it expires (TORCHYARD_DATASET_URL_TTL_S, each attempt gets new ones):
nothing to write, nothing of another dataset. It is computed from the key here, without a call to
the store or a permission the platform's key does not already have; scoped temporary credentials
(STS AssumeRole with a session policy) would do as much but need a role set up in each store, and
still hand the ranks a key."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from torchyard import datasets as fmt
from torchyard.settings import Settings
from torchyard.shardfiles import OBJECTS


@dataclass(frozen=True)
class Access:
    """How a run's ranks reach its dataset: the folder they read it in (TORCHYARD_DATASET_DIR), and
    what the worker binds read-only into their namespace for that."""

    folder: Path
    readonly: tuple[Path, ...] = ()


class LocalStore:
    """Datasets as folders under ``root``, made world-readable: the ranks, another user, reach one
    only through the read-only bind the worker gives them."""

    setting = "TORCHYARD_DATASET_ROOT"

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, name: str) -> Path:
        return fmt.dataset_dir(self.root, name)

    def where(self, name: str) -> str:
        return str(self.folder(name))

    def create(self, name: str) -> None:
        """An empty dataset (what a create that crashed before its commit left goes first)."""
        self.remove(name)
        self.root.mkdir(parents=True, exist_ok=True)
        self.folder(name).mkdir()
        self.folder(name).chmod(0o755)

    def staging(self, name: str) -> Path:
        """Where an upload is streamed before it is checked: the dataset's folder, so the rename
        that publishes it never crosses a file system."""
        return self.folder(name)

    def put(self, name: str, file: str, source: Path) -> None:
        """Publishes ``source`` as the dataset's ``file`` (moved here; a store copies it: the caller removes it)."""
        source.chmod(0o644)
        os.replace(source, self.folder(name) / file)

    def write(self, name: str, file: str, data: str) -> None:
        fmt.write_public(self.folder(name) / file, data)

    def sizes(self, name: str) -> dict[str, int]:
        """Each file of the dataset that is there: its size."""
        try:
            entries = list(os.scandir(self.folder(name)))
        except FileNotFoundError:
            return {}
        return {e.name: e.stat().st_size for e in entries if e.is_file() and not e.name.startswith(".")}

    def remove(self, name: str) -> None:
        """Renamed away first (one step), so the name is free at once however long the removal takes."""
        doomed = self.root / f".deleted-{uuid.uuid4().hex}"
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.folder(name), doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def give(self, name: str, view: Path, ttl_s: int) -> Access:
        """The folder itself, bound read-only (``view`` is not needed: nothing is copied)."""
        folder = self.folder(name)
        if not (folder / fmt.MANIFEST).is_file():
            raise FileNotFoundError(f"{folder / fmt.MANIFEST} is not there")
        return Access(folder, (folder,))


class S3Store:
    """Datasets as objects under ``s3://BUCKET/PREFIX/<name>/``. The bucket is the operator's to
    make; the platform's key needs Get, Put, Delete and List on the prefix."""

    setting = "TORCHYARD_DATASET_STORE"

    def __init__(self, url: str, staging_root: Path, client: Any) -> None:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        self.bucket, self.prefix, self.client = bucket, prefix.strip("/"), client
        self.staging_root = staging_root

    def key(self, name: str, file: str = "") -> str:
        return "/".join(part for part in (self.prefix, fmt.checked_name(name), file) if part)

    def where(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}/"

    def create(self, name: str) -> None:
        self.remove(name)

    def staging(self, name: str) -> Path:
        """The api's own disk (TORCHYARD_DATASET_ROOT/.uploads): one shard at a time per upload,
        checked and indexed there, then sent to the store and removed."""
        folder = self.staging_root / ".uploads"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def put(self, name: str, file: str, source: Path) -> None:
        self.client.upload_file(str(source), self.bucket, self.key(name, file))  # multipart, from the file

    def write(self, name: str, file: str, data: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(name, file), Body=data.encode())

    def read(self, name: str, file: str) -> bytes | None:
        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self.key(name, file))["Body"].read())
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def sizes(self, name: str) -> dict[str, int]:
        prefix = self.key(name) + "/"
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return {o["Key"].removeprefix(prefix): int(o["Size"]) for page in pages for o in page.get("Contents", [])}

    def remove(self, name: str) -> None:
        keys = [self.key(name, file) for file in self.sizes(name)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1,000 keys a call
            chunk = [{"Key": k} for k in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})

    def give(self, name: str, view: Path, ttl_s: int) -> Access:
        """The view the ranks read (see the module): written into ``view``, inside the attempt's run
        directory. Sizes are as listed now: an object gone or shortened is a bad shard on every rank
        alike (``on_bad_shard``); one changed later fails its checksums when read."""
        manifest = self.read(name, fmt.MANIFEST)
        if manifest is None:
            raise FileNotFoundError(f"{self.where(name)}{fmt.MANIFEST} is not there")
        view.mkdir(parents=True, exist_ok=True)
        fmt.write_public(view / fmt.MANIFEST, manifest)
        sizes = self.sizes(name)
        objects = {}
        for entry in fmt.Manifest.read(view).shards:
            for file in (entry.file, fmt.index_for(entry.file)):
                url = self.client.generate_presigned_url(
                    "get_object", Params={"Bucket": self.bucket, "Key": self.key(name, file)}, ExpiresIn=ttl_s
                )
                objects[file] = {"url": url, "bytes": sizes.get(file)}
        fmt.write_public(view / OBJECTS, json.dumps(objects))  # file -> its URL and size (None: not there)
        return Access(view)


Store = LocalStore | S3Store


def open_store(settings: Settings) -> Store:
    if not settings.dataset_store:
        return LocalStore(settings.datasets)
    client = _client(
        settings.dataset_s3_endpoint_url,
        settings.dataset_s3_region,
        settings.dataset_s3_access_key_id,
        settings.dataset_s3_secret_access_key,
    )
    return S3Store(settings.dataset_store, settings.datasets, client)


@lru_cache(maxsize=4)
def _client(endpoint: str, region: str, key_id: str, secret: str) -> Any:
    """One client per store for the process (thread-safe; making one takes ~0.1 s). SigV4 (what
    presigned URLs of MinIO and of every AWS region take); path-style keys on an endpoint of its own
    (MinIO's default: no wildcard DNS for buckets)."""
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path" if endpoint else "auto"},
        retries={"mode": "standard", "max_attempts": 5},
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint or None,
        region_name=region,
        aws_access_key_id=key_id or None,
        aws_secret_access_key=secret or None,
        config=config,
    )
