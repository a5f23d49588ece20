"""The checkpoint layout on disk, shared by the ranks that write it (``workers/runtime/checkpoint.py``)
and the api that lists and serves it (``backend/checkpoints.py``).

A run's checkpoints live under ``<checkpoints>/<run id>/``. A save is staged in ``.step-<N>.partial``
and renamed to ``step-<N>`` once every rank's part is on disk and the ``COMPLETE`` marker (holding N)
is written: a directory without the marker, or a staging directory, is never a checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

COMPLETE = "COMPLETE"  # written last into a checkpoint: without it, it does not exist
_NAME = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def staging_dir(root: Path, step: int) -> Path:
    return root / f".step-{step}.partial"


def complete(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of each complete checkpoint under ``root``, oldest first. A symlinked step
    directory could point anywhere, so it is not a checkpoint the ranks wrote."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and not entry.is_symlink() and entry.is_dir() and (entry / COMPLETE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)
