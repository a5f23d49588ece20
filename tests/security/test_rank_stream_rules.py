"""What ingest takes from a rank stream, entry by entry (no stack: the rules themselves)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.screening import screen_rank_entry
from torchyard import streams

CURRENT = (2, 4)  # the run's current attempt, its world size


def metrics(**overrides: Any) -> dict[str, Any]:
    data = {"attempt": 2, "rank": 3, "dropped": 0, "points": [[1, 1.0, {"loss": 0.5}]], **overrides}
    return streams.encode(streams.METRICS, data)


TIMELINE = {
    "step": 5,
    "duration_us": 100,
    "names": ["aten::mm", "gloo:all_reduce"],
    "lanes": [
        {"label": "thread 1", "kind": "compute", "spans": [[0, 60, 0]], "dropped": 0},
        {"label": "thread 2", "kind": "comm", "spans": [[40, 60, 1]], "dropped": 0},
    ],
    "figures": {"prof_comm_time_s": 6e-05},
}


def profile(timeline: Any) -> dict[str, Any]:
    return streams.encode(streams.PROFILE, {"attempt": 2, "rank": 0, "step": 5, "timeline": timeline})


def test_a_well_formed_entry_of_the_current_attempt_is_taken() -> None:
    assert screen_rank_entry(metrics(), CURRENT)[2] == ""
    assert screen_rank_entry(profile(TIMELINE), CURRENT)[2] == ""


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t["lanes"][0].update(kind="<script>"),  # the api serves only the kinds it knows
        lambda t: t["lanes"][0].update(spans="many"),
        lambda t: t.pop("names"),
        lambda t: t["figures"].update(x="fast"),
    ],
)
def test_a_timeline_the_api_could_not_serve_is_refused(change: Any) -> None:
    """Stored, it would make the run's sampled-step endpoint a 500 (its response model)."""
    timeline = json.loads(json.dumps(TIMELINE))
    change(timeline)
    assert screen_rank_entry(profile(timeline), CURRENT)[2] == "malformed"


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (streams.encode(streams.REPORT, {"attempt": 2, "event": "exited", "status": "succeeded"}), "type"),
        (streams.encode(streams.LOGS, {"attempt": 2, "lines": [[0, 0.0, "forged"]]}), "type"),
        (streams.encode(streams.STATE, {"status": "succeeded"}), "type"),
        (metrics(attempt=1), "attempt"),
        (metrics(attempt=True), "attempt"),
        (metrics(rank=4), "rank"),
        (metrics(rank=-1), "rank"),
        (metrics(points=[[s, 1.0, {"loss": 1.0}] for s in range(10_001)]), "size"),
        (metrics(points=[[2**63, 1.0, {"loss": 1.0}]]), "malformed"),
        (metrics(points=[[1, 1.0, {"loss": "1"}]]), "malformed"),
        (metrics(points=[[1, 1.0]]), "malformed"),
        ({"type": "metrics", "data": "{not json"}, "malformed"),
        ({"type": "metrics", "data": json.dumps({"x": 1}), "extra": "1"}, "size"),
        ({"type": "metrics", "data": "x" * (4 << 20 + 1)}, "size"),
    ],
)
def test_anything_else_is_refused_with_a_reason(fields: dict[str, Any], why: str) -> None:
    assert screen_rank_entry(fields, CURRENT)[2] == why


def test_a_run_without_an_attempt_takes_nothing() -> None:
    assert screen_rank_entry(metrics(), None)[2] == "attempt"


def test_sse_cursors_cover_both_streams_and_refuse_what_redis_would() -> None:
    assert streams.parse_cursor("5-1_7-0") == ("5-1", "7-0")
    assert streams.parse_cursor("5-1") == ("5-1", "5-1")  # a bare stream id resumes both streams
    for bad in ("yesterday", "1" * 23, f"{2**64}-0", "1-2_3-4_5-6", "", "5-x"):
        assert streams.parse_cursor(bad) is None, bad
