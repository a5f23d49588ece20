"""What rank 0 tells the platform once per attempt about how its run ran (a ``facts`` entry on the
rank stream, ``torchyard/streams.py``): the shape of the world, the node's CPU cores, the calibrated
bus bandwidth per message size and how many collectives of each kind one step issues. Ingest keeps
it on the attempt (``Attempt.facts``); the scaling advisor (``backend/advisor.py``) projects from it
and the run's per-step metrics.

Not metrics: they hold once per attempt, not per step (logged as a step's points they look like
series with every other step missing), and a table is no scalar. Written by user-reachable code
(the rank), so every field is bounded and checked by ingest against this model."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from torchyard.collectives import Collective

MAX_SIZES = 16  # calibrated message sizes (workers/runtime/calibrate.py measures 4)


class RunFacts(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    world: int = Field(ge=1, le=1 << 16, description="ranks of the attempt")
    nodes: int = Field(ge=1, le=1 << 16)
    ranks_per_node: int = Field(ge=1, le=1 << 12)
    cpu_cores: int = Field(ge=1, le=1 << 16, description="CPU cores rank 0's process may run on (its node's share)")
    device: Literal["cpu", "cuda"]
    calibration: dict[int, float] = Field(
        default_factory=dict, description="message bytes → all-reduce busbw (GB/s) on the world group; {} on one rank"
    )
    ops_per_step: dict[Collective, int] = Field(
        default_factory=dict, description="collectives of each kind one step issued (at `step`)"
    )
    step: int = Field(0, ge=0, le=1 << 62, description="the step the collectives were counted at")

    @field_validator("calibration")
    @classmethod
    def _sizes(cls, table: dict[int, float]) -> dict[int, float]:
        if len(table) > MAX_SIZES:
            raise ValueError(f"calibration: {len(table)} sizes, at most {MAX_SIZES}")
        for size, busbw in table.items():
            if not (1 <= size <= 1 << 40 and 0 <= busbw <= 1e6):
                raise ValueError(f"calibration: {size} bytes at {busbw} GB/s is out of range")
        return dict(sorted(table.items()))

    @field_validator("ops_per_step")
    @classmethod
    def _counts(cls, ops: dict[Collective, int]) -> dict[Collective, int]:
        if any(not 0 <= n <= 1 << 20 for n in ops.values()):
            raise ValueError(f"ops_per_step: counts out of range: {ops}")
        return ops
