"""The two ends of a hang dump on the node: the worker reads what the ranks wrote as untrusted data
(``workers/diagnose.py``; links, FIFOs, oversized or stale files are refused, never read out) and
writes its request without following what the ranks left in its place (``rundirs.write_marker``);
a rank's dump stays within its bound however much it holds (``workers/runtime/hangdump.py``)."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

from torchyard import hangdump
from workers.diagnose import NO_ANSWER, collect, read_dump
from workers.rundirs import write_marker
from workers.runtime import hangdump as rank_side

REQUEST = "ab" * 16


def test_a_dump_is_read_only_as_a_regular_json_file_answering_this_request(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"request": REQUEST, "rank": 0, "stolen": "root's"}))
    (tmp_path / "link.json").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo.json")  # opening it for reading must not block the worker
    (tmp_path / "big.json").write_text(json.dumps({"request": REQUEST, "pad": "x" * hangdump.MAX_DUMP_BYTES}))
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "old.json").write_text(json.dumps({"request": "cd" * 16, "rank": 0}))
    (tmp_path / "good.json").write_text(json.dumps({"request": REQUEST, "rank": 3}))

    def why(name: str) -> str:
        dump, reason = read_dump(tmp_path / name, REQUEST)
        assert dump is None
        return reason

    assert why("link.json").startswith("its dump cannot be opened")
    assert why("fifo.json") == "its dump is not a regular file"
    assert why("big.json") == f"its dump is larger than {hangdump.MAX_DUMP_BYTES} bytes"
    assert why("text.json") == "its dump is not JSON" and why("list.json") == "its dump is not a JSON object"
    assert why("old.json") == why("absent.json") == NO_ANSWER
    assert read_dump(tmp_path / "good.json", REQUEST) == ({"request": REQUEST, "rank": 3}, "")


def test_the_request_replaces_a_link_the_ranks_planted_without_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    request = tmp_path / hangdump.REQUEST_FILE
    request.symlink_to(victim)
    write_marker(request, REQUEST)
    assert victim.read_text() == "root's file"
    assert not request.is_symlink() and request.read_text() == REQUEST
    assert stat.S_IMODE(request.stat().st_mode) == 0o644  # the ranks run as another user


def test_the_worker_waits_for_the_answers_and_says_which_ranks_stayed_silent(tmp_path: Path) -> None:
    (tmp_path / hangdump.dump_file(0)).write_text(json.dumps({"request": "old", "rank": 0}))  # a stale answer

    def rank_zero_answers() -> None:  # as a rank's dump thread does, once it sees the request
        request = tmp_path / hangdump.REQUEST_FILE
        while not request.exists():
            threading.Event().wait(0.01)
        rank_side.write(tmp_path / hangdump.dump_file(0), {"request": request.read_text(), "rank": 0, "threads": []})

    # The wait ends by a clock that stands still until rank 0 has answered (a real second could pass
    # before the answering thread runs, on busy cores) and runs out on the look after that one.
    answering = threading.Thread(target=rank_zero_answers)
    looks_since_answered: list[None] = []

    def clock() -> float:
        if not answering.is_alive() and answering.ident is not None:
            looks_since_answered.append(None)
        return float("inf") if len(looks_since_answered) > 1 else 0.0

    answering.start()
    dumps, missing = collect(tmp_path, 2, REQUEST, wait_s=1.0, clock=clock)
    answering.join()
    assert [d["rank"] for d in dumps] == [0] and missing == {"1": NO_ANSWER}


def test_a_rank_dump_is_cut_to_its_bound_keeping_the_newest_entries(tmp_path: Path) -> None:
    entries = [{"collective_seq_id": n, "pad": "x" * 2000} for n in range(hangdump.MAX_ENTRIES)]
    frames = [{"file": "f.py", "line": n, "func": "f", "code": "y" * 150, "lib": False} for n in range(40)]
    data = {
        "request": REQUEST,
        "flight_recorder": {"entries": entries, "entries_cut": 0},
        "threads": [{"id": t, "frames": list(frames), "cut": 0} for t in range(hangdump.MAX_THREADS)],
    }
    raw = rank_side.encode(data)
    assert len(raw) <= hangdump.MAX_DUMP_BYTES
    kept = json.loads(raw)["flight_recorder"]
    assert kept["entries"][-1]["collective_seq_id"] == hangdump.MAX_ENTRIES - 1
    assert kept["entries_cut"] + len(kept["entries"]) == hangdump.MAX_ENTRIES


def test_every_other_threads_stack_is_in_a_dump_with_the_run_code_told_from_the_libraries() -> None:
    seen: list[dict] = []
    inside, done = threading.Event(), threading.Event()

    def dumps_while_the_main_thread_waits() -> None:  # as the dump thread answers while the main one is stuck
        inside.wait()  # the main thread is in stuck_in_a_collective: no sample of it inside Thread.start
        seen.extend(rank_side.threads())
        done.set()

    def stuck_in_a_collective() -> None:
        inside.set()
        done.wait()

    dumper = threading.Thread(target=dumps_while_the_main_thread_waits, name="dumper")
    dumper.start()
    stuck_in_a_collective()
    dumper.join()
    assert seen[0]["main"] and all(t["name"] != "dumper" for t in seen)
    frames = seen[0]["frames"]
    own = [i for i, f in enumerate(frames) if not f["lib"]]
    assert [frames[i]["func"] for i in own[-2:]] == [
        "test_every_other_threads_stack_is_in_a_dump_with_the_run_code_told_from_the_libraries",
        "stuck_in_a_collective",
    ]
    # below the run's code, only the libraries' (threading.py's set or wait: the sample may land in either)
    assert all(f["lib"] for f in frames[own[-1] + 1 :]), frames[own[-1] :]
    assert any(f["lib"] and f"{os.sep}_pytest{os.sep}" in f["file"] for f in frames[: own[0]]), "pytest's, above it"
