"""/api/v1/runs/{id}/projection: the scaling advisor (``backend/advisor.py``): a finished run's step
time, samples/s, scaling efficiency and memory per rank projected to other world sizes."""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Query

from backend import advisor, errors, scaling
from backend.deps import RunDep, SessionDep
from backend.schemas import MeasuredOut, Problem, ProjectionOut

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])


def parse_ranks(text: str | None) -> list[int]:
    """``1,2,4`` → [1, 2, 4]; ``2-8`` a range too; InvalidRequest naming what is wrong."""
    if text is None:
        return list(advisor.DEFAULT_RANKS)
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())) or len(part) > 12:
            raise errors.InvalidRequest(
                ["query", "ranks"],
                f"ranks: {part.strip()[:20]!r} is not a number of ranks (e.g. 1,2,4 or 2-8)",
                text[:100],
            )
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first or last - first >= advisor.MAX_POINTS:
            raise errors.InvalidRequest(["query", "ranks"], f"ranks: {part.strip()!r} is not a range of at most "
                                        f"{advisor.MAX_POINTS}", text[:100])  # fmt: skip
        out.extend(range(first, last + 1))
    return out


@router.get(
    "/{run_id}/projection",
    response_model=ProjectionOut,
    responses={409: {"model": Problem, "description": "a run the advisor cannot project from, and why"}},
)
def get_projection(
    run: RunDep,
    session: SessionDep,
    ranks: Annotated[
        str | None,
        Query(
            max_length=400, description="world sizes: a comma list, ranges allowed (1,2,4 or 1-64); default 1,2,4,…,64"
        ),
    ] = None,
    ranks_per_node: Annotated[int | None, Query(ge=1, le=advisor.MAX_RANKS, description="default: as the run")] = None,
    cores_per_node: Annotated[
        int | None, Query(ge=1, le=1 << 16, description="CPU cores a node has (CPU runs; default: the run's node)")
    ] = None,
) -> dict[str, Any]:
    """A finished DDP or FSDP run projected to other world sizes (weak scaling: each rank keeps its
    batch), with the assumptions in the run's own figures; 409 for a run it cannot project from."""
    asked = parse_ranks(ranks)
    m = scaling.measured(session, run)
    try:
        p = advisor.project(m, asked, ranks_per_node, cores_per_node)
    except ValueError as exc:
        raise errors.InvalidRequest(["query", "ranks"], str(exc), ranks) from exc
    return {
        "run_id": run.id,
        "strategy": p.strategy,
        "measured": MeasuredOut.model_validate(m),
        "latency_s": p.link.latency_s,
        "busbw_GBps": None if math.isinf(p.link.busbw_GBps) else p.link.busbw_GBps,
        "comm_efficiency": p.comm_efficiency,
        "points": p.points,
        "assumptions": p.assumptions,
        "excluded": p.excluded,
    }
