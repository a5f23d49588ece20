"""The datasets data layer and store: a dataset's rows (flushed, never committed: the caller owns
the transaction) and its files in the platform's dataset store (``torchyard/stores.py``: a folder
under TORCHYARD_DATASET_ROOT, or an S3-compatible object store; the format is
``torchyard/datasets.py``'s).

How the bytes get here: the client (``torchyard dataset create``) writes shards of ~64 MB and
uploads each with ``PUT /api/v1/datasets/<name>/shards/<n>`` (streamed to disk, bounded by
TORCHYARD_MAX_SHARD_BYTES), so a CLI on another machine works and an interrupted upload resends
one shard, not the dataset; ``POST .../complete`` then checks the shards are all there, writes the
manifest the ranks read and makes the dataset ``ready``. Every shard is checked and indexed here
(a tar of KEY.FIELD members; its sha256 must match what the client says it sent), so the registry
holds what the platform measured, never what a client claimed.

The ranks reach one dataset only: a folder through the read-only bind the worker gives them
(``workers/isolation.py``), an object store's through presigned GET URLs (``torchyard/stores.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend import errors
from backend.models import Dataset, DatasetShard, Run, Token, utcnow
from torchyard import datasets as fmt
from torchyard import stores
from torchyard.settings import Settings
from torchyard.spec import CharLMConfig, MlpConfig, RunSpec
from torchyard.states import TERMINAL

UPLOADING, READY = "uploading", "ready"
# The fields a built-in workload reads from each sample (workers/runtime/workloads.py decodes them).
BUILTIN_FIELDS = {
    "mlp": {"input.npy": "a float32 .npy vector of workload.params.input_dim values", "cls": "the class, as text"},
    "charlm": {"txt": "text (its first seq_len + 1 bytes are one training window)"},
}


class TooLarge(Exception):
    """A shard (or the dataset it would make) past its bound: a 413."""


def get_dataset(session: Session, name: str) -> Dataset:
    dataset = session.scalar(select(Dataset).where(Dataset.name == name))
    if dataset is None:
        raise errors.NotFound(f"dataset {name!r} not found")
    return dataset


def list_datasets(session: Session) -> Sequence[Dataset]:
    return session.scalars(select(Dataset).order_by(Dataset.name)).all()


def create_dataset(session: Session, settings: Settings, name: str, owner: Token | None) -> Dataset:
    """A new, empty dataset in ``uploading``; its folder made afresh (a crashed upload's leftovers go)."""
    existing = session.scalar(select(Dataset).where(Dataset.name == name))
    if existing is not None:
        raise errors.Conflict(
            f"dataset {name!r} exists ({existing.status}, {existing.samples:,} samples): delete it first "
            f"(DELETE /api/v1/datasets/{name}, `torchyard dataset delete {name}`) or choose another name"
        )
    if owner is not None:
        owned = session.scalar(select(func.count()).select_from(Dataset).where(Dataset.owner_id == owner.id)) or 0
        if owned >= settings.max_member_datasets:
            raise errors.LimitExceeded(
                f"token {owner.name!r} owns {owned} datasets, the most allowed (TORCHYARD_MAX_MEMBER_DATASETS): "
                "delete one first (`torchyard dataset delete NAME`)"
            )
    dataset = Dataset(
        name=name, status=UPLOADING, samples=0, bytes=0, digest="", schema={}, owner_id=owner.id if owner else None
    )
    session.add(dataset)
    try:  # the name is ours (its unique index) before its folder is touched: a create racing this one loses here
        session.flush()
    except IntegrityError:
        session.rollback()
        raise errors.Conflict(f"dataset {name!r} exists: another request created it just now") from None
    stores.open_store(settings).create(name)  # what a create that crashed before its commit left goes
    return dataset


def upload_path(settings: Settings, dataset: Dataset) -> Path:
    """Where a shard's body is streamed before it is checked (the store's staging folder)."""
    if dataset.status != UPLOADING:
        raise errors.Conflict(f"dataset {dataset.name!r} is {dataset.status}: its shards cannot change")
    return stores.open_store(settings).staging(dataset.name) / f".upload-{uuid.uuid4().hex}"


def check_room(settings: Settings, session: Session, dataset: Dataset, index: int, size: int) -> None:
    """TooLarge when a shard of ``size`` bytes at ``index`` passes a bound (its own, or the dataset's)."""
    if size > settings.max_shard_bytes:
        raise TooLarge(
            f"shard {index} is larger than {settings.max_shard_bytes:,} bytes, the most one shard may be "
            "(TORCHYARD_MAX_SHARD_BYTES): write smaller shards (`dataset create --shard-bytes`)"
        )
    others = session.scalar(
        select(func.coalesce(func.sum(DatasetShard.bytes), 0)).where(
            DatasetShard.dataset_id == dataset.id, DatasetShard.index != index
        )
    )
    if int(others or 0) + size > settings.max_dataset_bytes:
        raise TooLarge(
            f"dataset {dataset.name!r} would pass {settings.max_dataset_bytes:,} bytes with shard {index}, the most "
            "a dataset may hold (TORCHYARD_MAX_DATASET_BYTES)"
        )
    if dataset.owner_id is None:
        return
    owned = session.scalar(
        select(func.coalesce(func.sum(DatasetShard.bytes), 0))
        .join(Dataset, Dataset.id == DatasetShard.dataset_id)
        .where(Dataset.owner_id == dataset.owner_id)
        .where((DatasetShard.dataset_id != dataset.id) | (DatasetShard.index != index))
    )
    if int(owned or 0) + size > settings.max_member_dataset_bytes:
        raise TooLarge(
            f"shard {index} would take this token's datasets past {settings.max_member_dataset_bytes:,} bytes, "
            "the most one token's datasets may hold (TORCHYARD_MAX_MEMBER_DATASET_BYTES): delete a dataset first"
        )


def add_shard(
    settings: Settings, session: Session, dataset: Dataset, index: int, received: Path, sha256: str, claimed: str | None
) -> DatasetShard:
    """Checks and indexes a shard whose body is at ``received`` (removed whatever happens), then
    publishes it as shard ``index`` (replacing an earlier upload of that index)."""
    store = stores.open_store(settings)
    idx_tmp = received.with_name(received.name + ".idx")
    try:
        if claimed is not None and claimed.lower() != sha256:
            raise errors.InvalidRequest(
                ["header", "x-shard-sha256"],
                f"shard {index}: the body's sha256 is {sha256}, not {claimed} as X-Shard-SHA256 says: it was "
                "damaged on the way, send it again",
                claimed,
            )
        try:
            indexed = fmt.index_shard(received, idx_tmp, sha256)
        except fmt.BadShard as exc:
            raise errors.InvalidRequest(["body"], f"shard {index} of dataset {dataset.name!r}: {exc}", index) from None
        store.put(dataset.name, fmt.index_file(index), idx_tmp)  # the index first: a shard is never without it
        store.put(dataset.name, fmt.shard_file(index), received)
    finally:
        received.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
    shard = session.scalar(
        select(DatasetShard).where(DatasetShard.dataset_id == dataset.id, DatasetShard.index == index)
    )
    if shard is None:
        shard = DatasetShard(dataset_id=dataset.id, index=index)
        session.add(shard)
    shard.samples, shard.bytes, shard.sha256 = indexed.samples, indexed.bytes, indexed.sha256
    shard.index_sha256, shard.fields = indexed.index_sha256, indexed.fields
    shard.schema = {name: asdict(info) for name, info in indexed.schema.items()}
    session.flush()
    return shard


def complete(settings: Settings, session: Session, dataset: Dataset) -> Dataset:
    """Makes an uploaded dataset ``ready``: every shard 0..n-1 there, at least one sample; writes
    the manifest the ranks read. Completing a ready dataset changes nothing."""
    if dataset.status == READY:
        return dataset
    shards = sorted(dataset.shards, key=lambda s: s.index)
    store = stores.open_store(settings)
    missing = sorted(set(range(shards[-1].index + 1)) - {s.index for s in shards}) if shards else []
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise errors.InvalidRequest(
            ["path", "name"],
            f"dataset {dataset.name!r} is missing shards {shown} of 0..{shards[-1].index}: upload them "
            f"(PUT /api/v1/datasets/{dataset.name}/shards/N), then complete it",
            dataset.name,
        )
    samples = sum(s.samples for s in shards)
    if not samples:
        raise errors.InvalidRequest(
            ["path", "name"],
            f"dataset {dataset.name!r} is empty: {len(shards)} shards with no samples; upload at least one shard "
            "with a sample (files named KEY.FIELD) before completing it",
            dataset.name,
        )
    there = store.sizes(dataset.name)
    gone = [fmt.shard_file(s.index) for s in shards if fmt.shard_file(s.index) not in there]
    if gone:
        raise errors.Conflict(
            f"dataset {dataset.name!r}: the files of {', '.join(gone[:5])} are gone: upload them again"
        )
    manifest = fmt.make_manifest(
        dataset.name,
        [
            fmt.ShardEntry(fmt.shard_file(s.index), s.samples, s.bytes, s.sha256, s.index_sha256, list(s.fields))
            for s in shards
        ],
        [{name: fmt.FieldInfo(**info) for name, info in s.schema.items()} for s in shards],
    )
    dataset.samples, dataset.bytes, dataset.digest, dataset.schema = (
        manifest.samples,
        manifest.bytes,
        manifest.digest,
        manifest.schema,
    )
    store.write(dataset.name, fmt.MANIFEST, manifest.to_json())
    dataset.status, dataset.completed_at = READY, utcnow()
    session.flush()
    return dataset


def delete_dataset(settings: Settings, session: Session, dataset: Dataset) -> None:
    """Its rows and files; refused (409) while a run that is not over reads it."""
    readers = [
        f"{run.id} ({run.status})"
        for run in session.scalars(select(Run).where(Run.status.not_in(TERMINAL)).order_by(Run.id))
        if (run.spec.get("data") or {}).get("dataset") == dataset.name
    ]
    if readers:
        raise errors.Conflict(
            f"dataset {dataset.name!r} is read by run {', '.join(readers[:10])}: cancel it or wait until it ends"
        )
    session.delete(dataset)
    session.flush()
    stores.open_store(settings).remove(dataset.name)


# ---- runs that read a dataset -----------------------------------------------------------------


def check_run_data(session: Session, spec: RunSpec) -> None:
    """At submit: the dataset a run names exists, is ready, holds a global batch, and has the fields
    its built-in workload reads (else a 422 naming the field and what is wrong)."""
    if spec.data is None:
        return
    name, loc = spec.data.dataset, list[str | int](["body", "data", "dataset"])
    dataset = session.scalar(select(Dataset).where(Dataset.name == name))
    if dataset is None:
        known = ", ".join(d.name for d in session.scalars(select(Dataset).order_by(Dataset.name).limit(20)))
        raise errors.InvalidRequest(
            loc,
            f"data.dataset ({name!r}) is not a dataset: create it with `torchyard dataset create {name} --from DIR`"
            + (f" (datasets: {known})" if known else " (there are none yet)"),
            name,
        )
    if dataset.status != READY:
        raise errors.InvalidRequest(
            loc,
            f"data.dataset ({name!r}) is still {dataset.status} ({len(dataset.shards)} shards so far): complete its "
            "upload first",
            name,
        )
    workload = spec.workload
    if not isinstance(workload, MlpConfig | CharLMConfig):
        return  # a script reads it with torchyard.data.loader, in batches of its own choosing
    if dataset.samples < spec.training.batch_size:
        raise errors.InvalidRequest(
            loc,
            f"data.dataset ({name!r}) has {dataset.samples:,} samples, fewer than training.batch_size "
            f"({spec.training.batch_size}): not one step fits in an epoch",
            name,
        )
    for field, what in BUILTIN_FIELDS[workload.name].items():
        info = dataset.schema.get(field)
        if info is None or info["samples"] < dataset.samples:
            has = ", ".join(dataset.schema) or "none"
            raise errors.InvalidRequest(
                loc,
                f"data.dataset ({name!r}): workload {workload.name!r} reads the field {field!r} ({what}) of every "
                f"sample, and {'only ' + format(info['samples'], ',') + ' samples have it' if info else 'it has none'} "
                f"(its fields: {has})",
                name,
            )
    if isinstance(workload, MlpConfig):
        npy = dataset.schema["input.npy"].get("npy")
        want = {"dtype": "<f4", "shape": [workload.params.input_dim]}
        if npy != want:
            raise errors.InvalidRequest(
                ["body", "workload", "params", "input_dim"],
                f"workload.params.input_dim ({workload.params.input_dim}) does not match dataset {name!r}: its "
                f"input.npy is {npy or 'of varying dtype or shape'}, the mlp reads {want}",
                workload.params.input_dim,
            )
