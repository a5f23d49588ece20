"""/api/v1/pools: where runs go, and for a Slurm pool its partitions, nodes (``sinfo``) and the runs it holds."""

from __future__ import annotations

from fastapi import APIRouter

from backend import slurm_pools
from backend.deps import SessionDep, Viewer
from backend.schemas import PoolOut
from torchyard.settings import get_settings

router = APIRouter(prefix="/api/v1/pools", tags=["pools"])


@router.get("", response_model=list[PoolOut])
def list_pools(session: SessionDep, _viewer: Viewer) -> list[PoolOut]:
    settings = get_settings()
    default = settings.pool(None).name
    return [slurm_pools.describe_pool(session, settings, pool, pool.name == default) for pool in settings.pools]
