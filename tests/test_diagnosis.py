"""The hang comparison across ranks (``backend/diagnosis.py``) on dumps recorded from real hung
Gloo runs (``tests/fixtures/diagnosis``, recorded by ``python -m testkit.hangs``), and on what a
rank's own code could put in a dump instead."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from backend.diagnosis import analyze

FIXTURES = Path(__file__).parent / "fixtures" / "diagnosis"


def recorded(name: str) -> tuple[list[dict[str, Any]], int]:
    fixture = json.loads((FIXTURES / f"{name}.json").read_text())
    return fixture["dumps"], fixture["spec"]["resources"]["procs_per_node"]


def waiting_seq(dump: dict[str, Any]) -> tuple[str, int]:
    """(group, sequence number) of the collective the rank's recorder says it waits in."""
    (entry,) = [e for e in dump["flight_recorder"]["entries"] if not e["retired"]]
    return entry["process_group"][0], entry["collective_seq_id"]


def test_a_rank_that_skips_a_collective_is_named_with_where_it_went_instead() -> None:
    dumps, world = recorded("skip_collective_3")
    group, seq = waiting_seq(dumps[0])
    _, its_own = waiting_seq(dumps[1])
    diagnosis = analyze(dumps, world)
    assert diagnosis["headline"] == (
        f"rank 1 never entered all_reduce #{seq} (group {group}) that ranks 0, 2 wait in; "
        f"rank 1 waits in all_reduce #{its_own}"
    )
    first = diagnosis["findings"][0]
    assert (first["kind"], first["ranks"], first["waiting"]) == ("never_entered", [1], [0, 2])
    assert [r["state"] for r in diagnosis["ranks"]] == ["collective"] * 3


def test_two_ranks_waiting_on_each_other_across_groups_are_both_reported() -> None:
    dumps, world = recorded("skip_collective_2")
    findings = analyze(dumps, world)["findings"]
    assert {(f["kind"], tuple(f["ranks"]), tuple(f["waiting"])) for f in findings} == {
        ("never_entered", (1,), (0,)),
        ("never_entered", (0,), (1,)),
    }  # two ranks alone cannot say which broke away: both sides are shown


def test_a_different_collective_under_one_sequence_number_is_a_mismatch() -> None:
    dumps, world = recorded("other_collective_2")
    group, seq = waiting_seq(dumps[0])
    diagnosis = analyze(dumps, world)
    assert (
        diagnosis["headline"]
        == f"rank 0 in all_reduce #{seq} (group {group}), rank 1 in broadcast #{seq} (group {group})"
    )
    assert diagnosis["findings"][0]["kind"] == "mismatch"


def test_one_size_where_the_others_use_another_is_a_mismatch_naming_the_odd_rank() -> None:
    dumps, world = recorded("skip_collective_3")
    dumps = copy.deepcopy(dumps)
    dumps[1]["flight_recorder"]["entries"][-2]["input_sizes"] = [[697]]  # an all-reduce all ranks completed
    first = analyze(dumps, world)["findings"]
    mismatch = next(f for f in first if f["kind"].startswith("mismatch"))
    assert (
        mismatch["ranks"] == [1] and "of [[697]] float" in mismatch["text"] and "of [[698]] float" in mismatch["text"]
    )


def test_a_rank_sleeping_in_its_data_loading_is_named_with_its_innermost_frame() -> None:
    dumps, world = recorded("data_loading_2")
    _, seq = waiting_seq(dumps[0])
    diagnosis = analyze(dumps, world)
    assert diagnosis["headline"].startswith(
        f"rank 1 never entered all_reduce #{seq} that rank 0 waits in; rank 1 is at workloads.py:"
    )
    assert "in __getitems__ (time.sleep(1.0))" in diagnosis["headline"]
    stuck = diagnosis["ranks"][1]
    assert stuck["state"] == "python" and stuck["frames"][-1]["func"] == "__getitems__"
    assert stuck["innermost"]["func"] == "__getitems__"  # time.sleep is C: the data set's frame is the last
    assert diagnosis["ranks"][0]["where"] == f"waits in all_reduce #{seq}" and diagnosis["ranks"][0]["waiting_s"] > 0


def test_a_rank_stuck_in_python_while_the_others_wait_is_named() -> None:
    dumps, world = recorded("python_3")
    _, seq = waiting_seq(dumps[0])
    headline = analyze(dumps, world)["headline"]
    assert headline.startswith(
        f"rank 2 never entered all_reduce #{seq} that ranks 0, 1 wait in; rank 2 is at hangs.py:"
    )


def test_ranks_all_in_python_are_reported_together_by_place() -> None:
    dumps, world = recorded("python_all_2")
    diagnosis = analyze(dumps, world)
    assert diagnosis["findings"][0]["kind"] == "no_collective"
    assert diagnosis["headline"].startswith(
        "no rank waits in a collective: the ranks are in Python (ranks 0, 1 at hangs.py:"
    )


def test_a_rank_that_did_not_answer_is_said_so_with_the_reason() -> None:
    dumps, world = recorded("python_3")
    diagnosis = analyze(dumps[:2], world, {"2": "no answer within 5 s"})
    kinds = [(f["kind"], f["ranks"]) for f in diagnosis["findings"]]
    assert kinds == [("waits_on_silent", [2]), ("silent", [2])]
    assert diagnosis["findings"][1]["text"] == "rank 2 did not answer: no answer within 5 s"
    assert diagnosis["ranks"][2]["state"] == "silent" and diagnosis["answered"] == 2


def test_the_group_table_has_each_ranks_last_collective_entered_and_completed() -> None:
    dumps, world = recorded("skip_collective_3")
    tables = {t["group"]: t for t in analyze(dumps, world)["groups"]}
    side = {row["rank"]: row for row in tables["1"]["ranks"]}
    assert side[1] == {"rank": 1, "entered": 0, "completed": 0, "last": None}
    assert side[0]["last"] == {"seq": 1, "op": "all_reduce", "sizes": "[[8]] float", "state": "waiting"}
    assert tables["0"]["label"] == "default group" and tables["1"]["label"] == "group 1"


@pytest.mark.parametrize(
    "dumps",
    [
        [None, 5, "x", [], {"rank": "zero"}, {"rank": 99}, {"rank": True}],
        [{"rank": 0, "flight_recorder": {"entries": [1, None, {"process_group": 3, "collective_seq_id": "x"}],
                                         "pg_status": [1]}, "threads": "no", "groups": {"0": {"ranks": [0, "1", 7]}}}],
        [{"rank": 0, "flight_recorder": "none", "threads": [{"frames": [{"line": "x"}, 3]}], "groups": []}],
        [{"rank": 1, "flight_recorder": {"entries": [{"process_group": ["0"], "collective_seq_id": 2 ** 80,
                                                      "retired": "yes", "input_sizes": "big"}]}}],
    ],
)  # fmt: skip
def test_anything_a_rank_could_write_instead_of_a_dump_is_read_without_an_error(dumps: list[Any]) -> None:
    diagnosis = analyze(dumps, 2)
    assert isinstance(diagnosis["headline"], str) and len(diagnosis["ranks"]) == 2
    json.dumps(diagnosis)  # it can be stored and served as it is


def test_long_rank_lists_are_collapsed_into_runs() -> None:
    dumps, _ = recorded("python_3")
    silent = analyze(dumps[:1], 64)["findings"][-1]
    assert (silent["kind"], silent["text"]) == ("silent", "ranks 1–63 did not answer: no dump came")


def test_nccls_own_recorder_is_read_and_kept_apart_from_gloos_under_one_group_name() -> None:
    dumps, world = recorded("data_loading_2")
    _, seq = waiting_seq(dumps[0])
    alone, beside = copy.deepcopy(dumps), copy.deepcopy(dumps)
    for dump in alone:  # a CUDA build: NCCL's ring apart, Gloo's empty
        dump["flight_recorder_cuda"], dump["flight_recorder"] = (
            dump["flight_recorder"],
            {"entries": [], "pg_status": {}},
        )
    assert analyze(alone, world)["headline"].startswith(f"rank 1 never entered all_reduce #{seq} that rank 0 waits in")
    gloo_call = {"process_group": ["0", "default_pg"], "pg_id": 0, "collective_seq_id": 1, "retired": True,
                 "profiling_name": "gloo:barrier", "input_sizes": [], "input_dtypes": []}  # fmt: skip
    for dump in beside:  # one group on two backends ("cpu:gloo,cuda:nccl"): two sequences
        dump["flight_recorder_cuda"] = dump["flight_recorder"]
        dump["flight_recorder"] = {"entries": [gloo_call], "pg_status": {"0": {"last_completed_collective": "1"}}}
    diagnosis = analyze(beside, world)
    assert diagnosis["headline"].startswith(
        f"rank 1 never entered all_reduce #{seq} (default group, NCCL) that rank 0 waits in"
    )
    assert {g["group"]: g["label"] for g in diagnosis["groups"]} == {
        "0": "default group",
        "0 cuda": "default group, NCCL",
    }


def test_with_the_recorder_off_the_diagnosis_says_so_and_shows_where_the_ranks_are() -> None:
    dumps, world = recorded("python_3")
    off = [{**copy.deepcopy(d), "fr_buffer_size": 0} for d in dumps]
    headline = analyze(off, world)["headline"]
    assert headline.startswith("no collective to compare (the Flight Recorder is off (TORCHYARD_FR_BUFFER_ENTRIES=0))")
    assert "rank 2 at hangs.py:" in headline and "ranks 0, 1 at base.py:" in headline
