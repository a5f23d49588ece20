"""/api/v1/runs/{run_id}/checkpoints: a run's complete checkpoints, and each one as a tar archive."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Response, status
from fastapi.responses import StreamingResponse

from backend import checkpoints, runs
from backend.deps import DB_INT_MAX, Member, RunId, SessionDep, Viewer, check_owner
from backend.schemas import CheckpointOut, Problem
from torchyard.settings import get_settings

router = APIRouter(prefix="/api/v1/runs", tags=["checkpoints"])
Step = Annotated[int, Path(ge=0, le=DB_INT_MAX, description="the checkpoint's step")]
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": Problem, "description": "no such run or checkpoint"}}


@router.get("/{run_id}/checkpoints", response_model=list[CheckpointOut], responses=NOT_FOUND)
def list_checkpoints(run_id: RunId, session: SessionDep, _viewer: Viewer) -> list[CheckpointOut]:
    """The run's complete checkpoints, oldest first (none yet: an empty list)."""
    return [
        CheckpointOut(step=c.step, size_bytes=c.size_bytes, files=c.files, created_at=c.created_at)
        for c in checkpoints.list_checkpoints(session, get_settings(), run_id)
    ]


@router.delete(
    "/{run_id}/checkpoints",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses={**NOT_FOUND, 409: {"model": Problem, "description": "the run has not ended"}},
)
def delete_checkpoints(run_id: RunId, session: SessionDep, token: Member) -> Response:
    """Every checkpoint of a run that has ended, removed (its owner or an admin): what frees room
    under TORCHYARD_MAX_MEMBER_CHECKPOINT_BYTES."""
    run = runs.get_run(session, run_id)
    check_owner(run, token, "delete the checkpoints of")
    checkpoints.delete_checkpoints(session, get_settings(), run)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get(
    "/{run_id}/checkpoints/{step}/download",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "the checkpoint as a tar archive of its directory `step-<N>/`",
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
        },
        **NOT_FOUND,
    },
)
def download_checkpoint(run_id: RunId, step: Step, session: SessionDep, _viewer: Viewer) -> StreamingResponse:
    """The checkpoint at ``step`` as a tar archive (not compressed: tensors hardly compress), with
    its Content-Length; a step without a complete checkpoint is a 404 naming the steps there are."""
    info = checkpoints.get_checkpoint(session, get_settings(), run_id, step)
    session.close()  # a long download must not hold a pooled database connection
    archive = checkpoints.Archive(info)
    return StreamingResponse(
        iter(archive),
        media_type="application/x-tar",
        headers={
            "Content-Length": str(archive.length),
            "Content-Disposition": f'attachment; filename="run-{run_id}-step-{step}.tar"',
        },
    )
