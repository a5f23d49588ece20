"""The cancel marker is written by the worker (root, where runs are isolated) into the run dir, which
the ranks write in: whatever they plant at its path must not turn that write against the platform."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from workers.cancel import CANCEL_MARKER, mark_cancel


def test_the_marker_is_a_world_readable_file_saying_why(tmp_path: Path) -> None:
    mark_cancel(tmp_path, "the worker is stopping")
    marker = tmp_path / CANCEL_MARKER
    assert marker.read_text() == "the worker is stopping"
    assert stat.S_IMODE(marker.stat().st_mode) == 0o644 and not marker.is_symlink()


def test_a_planted_link_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "platform-secret"
    victim.write_text("keep me")
    victim.chmod(0o600)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / CANCEL_MARKER).symlink_to(victim)
    mark_cancel(run_dir, "cancelled")
    assert victim.read_text() == "keep me" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    marker = run_dir / CANCEL_MARKER
    assert not marker.is_symlink() and marker.read_text() == "cancelled"  # made afresh: the ranks still save


def test_a_planted_fifo_is_replaced_and_a_folder_refused_neither_blocking_nor_raising(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / CANCEL_MARKER)  # with no reader an open for writing would block forever
    mark_cancel(tmp_path, "cancelled")  # returns: the FIFO replaced, never opened
    assert (tmp_path / CANCEL_MARKER).read_text() == "cancelled"
    other = tmp_path / "other"
    (other / CANCEL_MARKER).mkdir(parents=True)
    mark_cancel(other, "cancelled")
    assert (other / CANCEL_MARKER).is_dir()
