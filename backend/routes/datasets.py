"""/api/v1/datasets: register a dataset, upload its shards one request each (streamed to disk),
complete it, list, read and delete it. The store and its rules: ``backend/datasets.py``."""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Path, Request, Response, status
from starlette.concurrency import run_in_threadpool

from backend import datasets
from backend.deps import Member, SessionDep, Viewer, check_owner
from backend.models import Dataset, DatasetShard
from backend.schemas import DatasetCreate, DatasetDetail, DatasetOut, FieldOut, ShardOut
from torchyard import datasets as fmt
from torchyard.settings import get_settings

router = APIRouter(prefix="/api/v1/datasets", tags=["datasets"])
DatasetName = Annotated[str, Path(pattern=fmt.NAME, description="the dataset's name")]
ShardIndex = Annotated[int, Path(ge=0, lt=fmt.MAX_SHARDS, description="the shard's number, from 0")]
# The route counts a body as it streams and answers past TORCHYARD_MAX_SHARD_BYTES with the bound's
# name; past twice that, Starlette's own 413 stops it early (from its Content-Length) or mid-stream.
SHARD_BODY_LIMIT = 2 * get_settings().max_shard_bytes


def dataset_out(dataset: Dataset) -> DatasetOut:
    return DatasetOut(
        name=dataset.name,
        status=dataset.status,  # type: ignore[arg-type]
        samples=dataset.samples,
        bytes=dataset.bytes if dataset.status == datasets.READY else sum(s.bytes for s in dataset.shards),
        shards=len(dataset.shards),
        digest=dataset.digest,
        schema_={k: FieldOut(**v) for k, v in dataset.schema.items()},
        created_at=dataset.created_at,
        completed_at=dataset.completed_at,
    )


def _shard_out(shard: DatasetShard) -> ShardOut:
    return ShardOut(
        index=shard.index,
        file=fmt.shard_file(shard.index),
        samples=shard.samples,
        bytes=shard.bytes,
        sha256=shard.sha256,
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=DatasetOut)
def create_dataset(body: DatasetCreate, session: SessionDep, token: Member) -> DatasetOut:
    """A new dataset, ``uploading``: upload its shards, then complete it. 409 if the name is taken."""
    dataset = datasets.create_dataset(session, get_settings(), body.name, token)
    session.commit()
    return dataset_out(dataset)


@router.get("", response_model=list[DatasetOut])
def list_datasets(session: SessionDep, _viewer: Viewer) -> list[DatasetOut]:
    return [dataset_out(d) for d in datasets.list_datasets(session)]


@router.get("/{name}", response_model=DatasetDetail)
def get_dataset(name: DatasetName, session: SessionDep, _viewer: Viewer) -> DatasetDetail:
    """The dataset with every shard's samples, bytes and sha256."""
    dataset = datasets.get_dataset(session, name)
    return DatasetDetail(
        **dataset_out(dataset).model_dump(by_alias=True), shard_list=[_shard_out(s) for s in dataset.shards]
    )


@router.put("/{name}/shards/{index}", response_model=ShardOut, max_body_size=SHARD_BODY_LIMIT)
async def upload_shard(
    name: DatasetName,
    index: ShardIndex,
    request: Request,
    session: SessionDep,
    token: Member,
    claimed: Annotated[
        str | None,
        Header(alias="X-Shard-SHA256", pattern=r"^[0-9a-fA-F]{64}$", description="the body's sha256, checked"),
    ] = None,
) -> ShardOut:
    """The body is shard ``index`` itself (a tar of KEY.FIELD members, application/x-tar), streamed
    to disk; checked, indexed and stored (again: replaces that shard's earlier upload). 413 past
    TORCHYARD_MAX_SHARD_BYTES or the dataset's TORCHYARD_MAX_DATASET_BYTES; 422 naming what is
    wrong with it; 409 once the dataset is complete."""
    settings = get_settings()
    dataset = await run_in_threadpool(datasets.get_dataset, session, name)
    check_owner(dataset, token, "change")
    length = request.headers.get("content-length")
    try:
        if length and length.isdigit():
            await run_in_threadpool(datasets.check_room, settings, session, dataset, index, int(length))
        path = datasets.upload_path(settings, dataset)
        digest, size = hashlib.sha256(), 0
        try:
            with path.open("wb") as out:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > settings.max_shard_bytes:
                        await run_in_threadpool(datasets.check_room, settings, session, dataset, index, size)
                    digest.update(chunk)
                    out.write(chunk)
            await run_in_threadpool(datasets.check_room, settings, session, dataset, index, size)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
    except datasets.TooLarge as exc:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, str(exc)) from None
    shard = await run_in_threadpool(
        datasets.add_shard, settings, session, dataset, index, path, digest.hexdigest(), claimed
    )
    session.commit()
    return _shard_out(shard)


@router.post("/{name}/complete", response_model=DatasetOut)
def complete_dataset(name: DatasetName, session: SessionDep, token: Member) -> DatasetOut:
    """Checks every shard 0..n-1 is there and the dataset has samples (else 422 naming what is
    missing), writes the manifest the ranks read, and makes it ``ready``."""
    dataset = datasets.get_dataset(session, name)
    check_owner(dataset, token, "change")
    datasets.complete(get_settings(), session, dataset)
    session.commit()
    return dataset_out(dataset)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
def delete_dataset(name: DatasetName, session: SessionDep, token: Member) -> Response:
    """Removes the dataset and its files; 409 while a run that has not ended reads it."""
    dataset = datasets.get_dataset(session, name)
    check_owner(dataset, token, "change")
    datasets.delete_dataset(get_settings(), session, dataset)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
