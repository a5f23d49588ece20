"""/api/v1/nodes: the cluster as the scheduler sees it."""

from __future__ import annotations

from fastapi import APIRouter

from backend import nodes
from backend.deps import SessionDep, Viewer
from backend.schemas import NodeOut

router = APIRouter(prefix="/api/v1/nodes", tags=["nodes"])


@router.get("", response_model=list[NodeOut])
def list_nodes(session: SessionDep, _viewer: Viewer) -> list[NodeOut]:
    return nodes.describe(session)
