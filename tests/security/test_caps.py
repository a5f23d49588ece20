"""Per-run caps the kernel holds (``workers/caps.py``): a fork bomb stops at the run's process cap,
a memory hog is killed at its memory cap, each with the reason the run's failure will carry, a
process that left the run's process group and session is still ended with the share, and the
disk watch measures what a run's files take (sparse files by what they hold, never through a link).
Run as the worker runs them: as root, in a control group of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchyard.runfiles import disk_usage
from workers import caps

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0, reason="control groups are made by a root worker"),
]

FORK_BOMB = """
import os, sys, time
children = 0
try:
    while True:
        if os.fork() == 0:
            os.close(1), os.close(2)  # the parent's output ends when it does: run() waits no longer
            time.sleep(30)
            os._exit(0)
        children += 1
except OSError as exc:
    print("refused after", children, exc.strerror, flush=True)
    sys.exit(3)
"""
MEMORY_HOG = "blocks = [bytearray(16 << 20) for _ in range(64)]"  # 1 GiB, touched
ESCAPER = (
    "import subprocess as s; s.Popen(['sleep', '300'], start_new_session=True, stdout=s.DEVNULL, stderr=s.DEVNULL)"
)


def run_in(group: caps.RunGroup, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(group.enter([sys.executable, "-c", script]), capture_output=True, text=True, timeout=50)


@pytest.fixture
def group(request: pytest.FixtureRequest) -> caps.RunGroup:
    made = caps.RunGroup.create(1, 1, request.param)
    if made is None:
        pytest.fail(caps.support())  # root on Linux with cgroups mounted: this machine, and CI's
    request.addfinalizer(made.remove)
    return made


@pytest.mark.parametrize("group", [caps.Caps(pids=32, memory_bytes=0)], indirect=True)
def test_a_fork_bomb_stops_at_the_process_cap_and_says_so(group: caps.RunGroup) -> None:
    done = run_in(group, FORK_BOMB)
    assert done.returncode == 3 and "refused after" in done.stdout, done
    assert int(done.stdout.split()[2]) < 32  # the interpreter and its children, together under the cap
    [reason] = group.breaches()
    assert "cap of 32 processes and threads" in reason and "fork(s) refused" in reason


@pytest.mark.parametrize("group", [caps.Caps(pids=0, memory_bytes=128 << 20)], indirect=True)
def test_a_memory_hog_is_killed_at_the_memory_cap_and_says_so(group: caps.RunGroup) -> None:
    done = run_in(group, MEMORY_HOG)
    assert done.returncode == -9, done  # the OOM killer, in this group only
    [reason] = group.breaches()
    assert "memory cap of 128 MiB" in reason and "1 process(es) killed" in reason


@pytest.mark.parametrize("group", [caps.Caps(pids=64, memory_bytes=0)], indirect=True)
def test_a_process_that_left_the_session_is_ended_with_the_share(group: caps.RunGroup) -> None:
    done = run_in(group, ESCAPER)
    assert done.returncode == 0 and not group.breaches()
    left = [int(p) for p in (group.dirs["pids"] / "cgroup.procs").read_text().split()]
    assert len(left) == 1, left  # the detached sleep, still there
    group.remove()
    assert not Path(f"/proc/{left[0]}").exists() or Path(f"/proc/{left[0]}/stat").read_text().split()[2] == "Z"
    assert not group.dirs["pids"].exists()


def test_disk_usage_counts_blocks_not_links_and_stops_past_the_bound(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "data").write_bytes(os.urandom(1 << 20))
    with (tmp_path / "run" / "sparse").open("wb") as f:
        f.truncate(1 << 30)  # 1 GiB long, nothing in it
    (tmp_path / "elsewhere").write_bytes(os.urandom(4 << 20))
    (tmp_path / "run" / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "run" / "dirlink").symlink_to(tmp_path, target_is_directory=True)
    used = disk_usage([tmp_path / "run"], stop_above=1 << 30)
    assert 1 << 20 <= used < 2 << 20
    assert disk_usage([tmp_path / "run"], stop_above=0) == used  # one file in: past the bound, stops
