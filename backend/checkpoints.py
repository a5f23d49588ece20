"""A run's checkpoints as the api sees them: read from the checkpoint root (the directory the
ranks save into, shared storage on several hosts), listed, and streamed as a tar archive.

Only complete checkpoints exist here: a directory ``step-<N>`` holding the ``COMPLETE`` marker
(``workers.runtime.checkpoint`` writes it last, then publishes the directory by a rename); a
hidden staging directory, or a ``step-<N>`` without the marker, is never listed or served.

Why plain tar, not tar.gz: a checkpoint is mostly float tensors, which gzip shrinks by a few per
cent at the cost of a CPU core per download (tens of MB/s); plain tar streams at disk speed and
its exact size is known before the first byte, so the response carries a Content-Length (a client
shows progress against it, and a cut-off download is detected as short)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.errors import Conflict, LimitExceeded, NotFound
from backend.models import Run, Token
from backend.runs import get_run
from torchyard import checkpoints as layout
from torchyard.runfiles import RunDir, disk_usage, open_regular
from torchyard.settings import Settings
from torchyard.states import TERMINAL

CHUNK = 1 << 20
_BLOCK = tarfile.BLOCKSIZE


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    size_bytes: int  # the files' bytes (the tar archive is a little larger: headers)
    files: int
    created_at: datetime  # when it was completed (its COMPLETE marker's mtime)


def run_root(settings: Settings, run_id: int) -> Path:
    return settings.checkpoints / str(run_id)


def _files(step: RunDir) -> list[tuple[str, os.stat_result]]:
    """Every regular file in a checkpoint (relative POSIX path, stat), sorted; links, devices and
    the like are left out: a listing never counts what is outside the checkpoint."""
    found = []
    for top, names, dir_fd in step.walk():
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISREG(info.st_mode):
                    found.append((f"{top}/{name}" if top else name, info))
    return found


def _open_step(path: Path) -> RunDir:
    """The checkpoint directory ``<root>/step-<N>``, held open (never through a link the ranks put
    there). FileNotFoundError: it is gone, is a link now (the ranks rotated it, or swapped it), or
    the ranks made it unreadable to the api."""
    try:
        with RunDir.open(path.parent) as root:
            return root.subdir(path.name)
    except OSError:
        raise FileNotFoundError(path) from None


def _info(step: int, path: Path) -> CheckpointInfo | None:
    try:
        with _open_step(path) as directory:
            files = _files(directory)
            marker = os.stat(layout.COMPLETE, dir_fd=directory.fd, follow_symlinks=False)
    except FileNotFoundError:  # removed by the ranks' rotation (the newest two are kept) meanwhile
        return None
    if not stat.S_ISREG(marker.st_mode):
        return None
    return CheckpointInfo(
        step=step,
        path=path,
        size_bytes=sum(info.st_size for _name, info in files),
        files=len(files),
        created_at=datetime.fromtimestamp(marker.st_mtime, UTC),
    )


def check_member_room(session: Session, settings: Settings, owner: Token | None) -> None:
    """LimitExceeded (429) when the kept checkpoints of ``owner``'s runs take more than
    TORCHYARD_MAX_MEMBER_CHECKPOINT_BYTES: every run keeps its final checkpoint, so without a
    bound one token's runs would fill the checkpoint disk of everyone's."""
    if owner is None or owner.role == "admin":
        return
    cap = settings.max_member_checkpoint_bytes
    run_ids = session.scalars(select(Run.id).where(Run.owner_id == owner.id)).all()
    used = disk_usage([run_root(settings, run_id) for run_id in run_ids], stop_above=cap)
    if used > cap:
        raise LimitExceeded(
            f"the checkpoints kept by token {owner.name!r}'s runs take {used / 2**20:,.0f} MiB, more than "
            f"{cap / 2**20:,.0f} MiB (TORCHYARD_MAX_MEMBER_CHECKPOINT_BYTES): delete some "
            "(DELETE /api/v1/runs/{id}/checkpoints) before the next run"
        )


def delete_checkpoints(session: Session, settings: Settings, run: Run) -> None:
    """Every checkpoint of an ended run, removed (never following a link the ranks left: rmtree
    works through directory handles); Conflict while it may still save or resume from them."""
    if run.status not in TERMINAL:
        raise Conflict(f"run {run.id} is {run.status}: its checkpoints can be deleted once it has ended")
    shutil.rmtree(run_root(settings, run.id), ignore_errors=True)


def list_checkpoints(session: Session, settings: Settings, run_id: int) -> list[CheckpointInfo]:
    """The run's complete checkpoints, oldest first; [] when it has none. NotFound: no such run."""
    get_run(session, run_id)
    return [info for step, path in layout.complete(run_root(settings, run_id)) if (info := _info(step, path))]


def get_checkpoint(session: Session, settings: Settings, run_id: int, step: int) -> CheckpointInfo:
    """NotFound, naming the steps there are, when the run has no complete checkpoint at ``step``."""
    get_run(session, run_id)
    root = run_root(settings, run_id)
    complete = dict(layout.complete(root))
    path = complete.get(step)
    # The path is built from an integer and checked again after resolving: never outside the root.
    info = _info(step, path) if path is not None and path.resolve().parent == root.resolve() else None
    if info is None:
        steps = ", ".join(str(s) for s in sorted(complete) if s != step)
        there = f"its checkpoints are at steps {steps}" if steps else "it has no complete checkpoint"
        raise NotFound(f"run {run_id} has no checkpoint at step {step}: {there}")
    return info


class Archive:
    """A checkpoint as a tar stream of known length. Its files are opened up front, so the ranks
    removing an old checkpoint (they keep the newest two) cannot cut a download that has started."""

    def __init__(self, info: CheckpointInfo) -> None:
        self.name = f"step-{info.step}"
        self.members: list[tuple[bytes, IO[bytes], int]] = []
        try:
            with _open_step(info.path) as directory:
                for top, names, dir_fd in directory.walk():
                    for name in names:
                        self._add(f"{top}/{name}" if top else name, name, dir_fd)
        except FileNotFoundError:
            self.close()
            raise NotFound(
                f"the checkpoint at step {info.step} was removed meanwhile (a newer one replaced it)"
            ) from None
        except BaseException:
            self.close()
            raise
        self.length = sum(len(h) + _padded(size) for h, _f, size in self.members) + 2 * _BLOCK

    def _add(self, rel: str, name: str, dir_fd: int) -> None:
        """The file, if it is a regular one reached without a link: opened here (its size and
        contents are those of what was opened, whatever the ranks do to the name afterwards)."""
        try:
            fd = open_regular(name, dir_fd)
        except OSError:  # a link or not a regular file (UnsafeFile), gone, or made unreadable to the api
            return
        handle = os.fdopen(fd, "rb")
        info = os.fstat(fd)
        self.members.append((self._header(rel, info.st_size, info.st_mtime), handle, info.st_size))

    def _header(self, rel: str, size: int, mtime: float) -> bytes:
        member = tarfile.TarInfo(f"{self.name}/{rel}")
        member.size, member.mtime, member.mode = size, int(mtime), 0o644
        return member.tobuf(format=tarfile.PAX_FORMAT)

    def __iter__(self) -> Iterator[bytes]:
        try:
            for header, handle, size in self.members:
                yield header
                left = size
                while left:
                    chunk = handle.read(min(CHUNK, left))
                    if not chunk:  # the file shrank under us: end short, the client sees the Content-Length unmet
                        raise OSError(f"a file of {self.name} ended {left} bytes early")
                    left -= len(chunk)
                    yield chunk
                handle.close()
                if size % _BLOCK:
                    yield b"\0" * (_BLOCK - size % _BLOCK)
            yield b"\0" * (2 * _BLOCK)  # end of archive
        finally:
            self.close()

    def close(self) -> None:
        for _header, handle, _size in self.members:
            handle.close()


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK
