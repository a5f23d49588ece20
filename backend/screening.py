"""What ingest takes from a rank stream (ranks run users' code; ``torchyard/streams.py`` says why):
only ``metrics``, ``profile`` and ``facts`` entries (facts from rank 0 alone), for the run's current
attempt and ranks below its world size, well-formed and within ``streams.RANK_LIMITS``. Anything
else is refused with a reason."""

from __future__ import annotations

import json
from typing import Any, TypeGuard

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.models import Attempt, Run
from backend.schemas import Timeline
from torchyard import streams
from torchyard.facts import RunFacts
from torchyard.spec import RunSpec

DB_INT_MAX = 2**63 - 1


def current_attempts(session: Session, run_ids: set[int]) -> dict[int, tuple[int, int]]:
    """Run id → (its current attempt number, its world size), for the runs that have an attempt."""
    if not run_ids:
        return {}
    latest = (
        select(Attempt.run_id, func.max(Attempt.number).label("number"))
        .where(Attempt.run_id.in_(run_ids))
        .group_by(Attempt.run_id)
        .subquery()
    )
    return {
        run_id: (int(number), RunSpec.model_validate(spec).world_size)
        for run_id, number, spec in session.execute(
            select(latest.c.run_id, latest.c.number, Run.spec).join(Run, Run.id == latest.c.run_id)
        )
    }


def screen_rank_entry(fields: dict[Any, Any], current: tuple[int, int] | None) -> tuple[str, dict[str, Any], str]:
    """``(type, data, why rejected)`` of one rank-stream entry; ``why`` is empty for an entry ingest
    may write. ``current``: the run's (current attempt, world size), None if it has no attempt."""
    limits = streams.RANK_LIMITS
    try:
        raw = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in fields.items()}
        if set(raw) != {"type", "data"} or len(raw["data"]) > limits["entry_bytes"]:
            return "", {}, "size"
        entry_type, data = streams.decode(fields)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return "", {}, "malformed"
    if entry_type not in streams.RANK_TYPES:
        return entry_type, data, "type"  # a report, logs or state from a rank: never trusted
    if not isinstance(data, dict):
        return entry_type, {}, "malformed"
    if current is None:
        return entry_type, data, "attempt"
    attempt, rank = data.get("attempt"), data.get("rank")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt != current[0]:
        return entry_type, data, "attempt"
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < current[1]:
        return entry_type, data, "rank"
    check = {streams.METRICS: _check_metrics, streams.PROFILE: _check_profile, streams.FACTS: _check_facts}
    return entry_type, data, check[entry_type](data)


def _check_metrics(data: dict[str, Any]) -> str:
    limits = streams.RANK_LIMITS
    points = data.get("points")
    if not isinstance(points, list) or not _is_int(data.get("dropped", 0)):
        return "malformed"
    if len(points) > limits["points"]:
        return "size"
    # Checked by the set of types in each column, not point by point: an entry holds up to 10,000
    # points of many scalars, and the JSON decoder makes exact types (never a subclass or a bool
    # posing as an int: bool is its own type here).
    if any(type(point) is not list or len(point) != 3 for point in points):
        return "malformed"
    steps = [point[0] for point in points]
    if {type(step) for step in steps} - {int} or (steps and not (min(steps) >= 0 and max(steps) <= DB_INT_MAX)):
        return "malformed"
    if {type(point[1]) for point in points} - _NUMBER or {type(point[2]) for point in points} - {dict}:
        return "malformed"
    # Keys too long or too many are the run's bounds' business (backend/limits.py: dropped per
    # key and counted), as for any run; here only what cannot be a point at all.
    if {type(value) for point in points for value in point[2].values()} - _NUMBER - {type(None)}:
        return "malformed"
    return ""


def _check_profile(data: dict[str, Any]) -> str:
    step, timeline = data.get("step"), data.get("timeline")
    if not (_is_int(step) and 0 <= step <= DB_INT_MAX) or not isinstance(timeline, dict):
        return "malformed"
    if len(json.dumps(timeline, separators=(",", ":"))) > streams.RANK_LIMITS["timeline_bytes"]:
        return "size"
    try:  # the shape the api serves: stored malformed, it would make the run's profile endpoint a 500
        Timeline.model_validate(timeline)
    except ValidationError:
        return "malformed"
    return ""


def _check_facts(data: dict[str, Any]) -> str:
    if data.get("rank") != 0:
        return "rank"  # rank 0 speaks for the attempt
    facts = data.get("facts")
    if not isinstance(facts, dict):
        return "malformed"
    if len(json.dumps(facts, separators=(",", ":"))) > streams.RANK_LIMITS["facts_bytes"]:
        return "size"
    try:
        data["facts"] = RunFacts.model_validate(facts).model_dump(mode="json")  # stored as checked
    except ValidationError:
        return "malformed"
    return ""


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


_NUMBER = {int, float}
