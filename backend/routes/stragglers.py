"""/api/v1/runs/{id}/stragglers and /heatmap: which rank the others wait for and why
(``backend/stragglers.py``), and every rank's step time (or one of its parts) over the steps."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from backend import metrics, stragglers
from backend.deps import DB_INT_MAX, RunDep, SessionDep
from backend.schemas import Heatmap, StragglersOut
from torchyard.streams import MAX_KEY_CHARS

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])


@router.get("/{run_id}/stragglers", response_model=StragglersOut)
def get_stragglers(
    run: RunDep,
    session: SessionDep,
    window: Annotated[int, Query(ge=1, le=stragglers.MAX_WINDOW, description="steps to look at")] = (
        stragglers.DEFAULT_WINDOW
    ),
    step_max: Annotated[int | None, Query(ge=1, le=DB_INT_MAX, description="the window's last step")] = None,
) -> dict[str, Any]:
    """The ranks the others wait for over a window of steps (default: the newest 100), each with its
    cause (data loading or compute) and how long the others wait for it per step; every rank's
    medians of step time, data, compute, exposed comm and arrival at the first collective."""
    return stragglers.window(session, run, window, step_max)


@router.get("/{run_id}/heatmap", responses={200: {"model": Heatmap}})
def get_heatmap(
    run: RunDep,
    session: SessionDep,
    key: Annotated[
        str, Query(min_length=1, max_length=MAX_KEY_CHARS, description="metric name, e.g. step_time_s")
    ] = "step_time_s",
    max_points: Annotated[int, Query(ge=1, le=metrics.MAX_POINTS, description="columns at most")] = 400,
    step_min: Annotated[int | None, Query(ge=0, le=DB_INT_MAX)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=DB_INT_MAX)] = None,
) -> dict[str, Any]:
    """Ranks × steps: each rank's mean of ``key`` per column of steps, downsampled on the server
    (columns of 2**k steps; long ranges read from the rollups), so it stays small at any length."""
    resources = run.run_spec.resources
    lo = max(1, step_min or 1)
    hi = min(run.last_step, step_max if step_max is not None else run.last_step)  # past it: no point to read
    return metrics.heatmap(session, run.id, key, max_points, lo, hi, resources.nodes * resources.procs_per_node)
