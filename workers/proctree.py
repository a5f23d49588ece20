"""Ending a run's process tree whole. torch elastic starts each rank in a session of its own, so
``killpg`` on the launcher's group alone would leave the ranks running: the tree is found first
(every descendant, whatever its group) and each member ended."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil


def end_process_group(pgid: int, grace_s: float) -> None:
    """SIGTERM the launcher's group (torchrun forwards it to its ranks), SIGKILL what remains
    after ``grace_s``. torch elastic starts every rank in a session of its own, out of reach of
    killpg: the ranks (and their children) are found as torchrun's descendants before anything is
    signalled, since a SIGKILLed torchrun would leave them running as orphans."""
    tree = _process_tree(pgid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.05)
    for proc in tree:
        if _alive(proc):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _process_tree(pgid: int) -> list[psutil.Process]:
    """The group's processes and all their descendants, whatever group or session they are in."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
    tree = {p.pid: p for p in members}
    for proc in members:
        with contextlib.suppress(psutil.Error):
            tree.update((c.pid, c) for c in proc.children(recursive=True))
    return list(tree.values())


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie is done; its parent just has not reaped it yet)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_run_process(pgid: int, run_id: int) -> bool:
    """A recorded pgid may have been reused by the OS: only end it if it is the run's torchrun."""
    try:
        environ = Path(f"/proc/{pgid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"TORCHYARD_RUN_ID={run_id}".encode() in environ
