"""Where a node's shares live on its disk: run directories (scratch: unpacked code, torchrun's logs,
markers; removed when a share ends), the records of the process groups it started, and the
marker of a worker shutting down. Checkpoints live elsewhere (``settings.checkpoints``) and stay."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from torchyard.settings import Settings


def stopping_marker(settings: Settings) -> Path:
    """Present while this node's worker is shutting down: a run it ends then says so."""
    return attempts_dir(settings).parent / "stopping"


def runs_dir(settings: Settings) -> Path:
    """This node's run directories (unpacked code, torchrun's logs, markers): scratch, removed
    when a share ends. Per node, so two workers sharing a state dir never touch each other's.
    Checkpoints live elsewhere (``settings.checkpoints``) and are kept."""
    return settings.state_dir / "workers" / settings.node_id / "runs"


def run_dir(settings: Settings, run_id: int, attempt: int) -> Path:
    """One share's run directory (its ranks' HOME; a script's code unpacked in ``code/``, their cwd)."""
    return runs_dir(settings) / str(run_id) / f"attempt-{attempt}"


def attempts_dir(settings: Settings) -> Path:
    """Where a worker records the process groups it started, so a restarted worker finds them."""
    path = settings.state_dir / "workers" / settings.node_id / "attempts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_run_dir(settings: Settings, run_id: int, attempt: int) -> None:
    """The share's scratch (unpacked code included); the run's folder too once no attempt is left."""
    shutil.rmtree(run_dir(settings, run_id, attempt), ignore_errors=True)
    with contextlib.suppress(OSError):  # another attempt of the run is here (or it is gone already)
        (runs_dir(settings) / str(run_id)).rmdir()


def remove_stale_run_dirs(settings: Settings) -> None:
    """At start, after ``end_orphans``: no share runs on this node yet, so every run directory
    here belongs to a share that ended while no worker was watching (killed with -9)."""
    shutil.rmtree(runs_dir(settings), ignore_errors=True)


def write_marker(path: Path, text: str) -> None:
    """A file the platform writes into a run directory for the ranks to read. World-readable: the
    ranks run as another user, and the platform's umask is 077. The directory is the run user's, so
    whatever the ranks left at ``path`` (a link to a file of root's, say) is removed first, and the
    file is made anew without following links: the platform never writes through a rank's link."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o644)
        f.write(text)
