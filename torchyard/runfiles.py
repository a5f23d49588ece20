"""Reading what a run wrote without trusting it: every file the platform reads or serves from a
place a run can write (its checkpoints, its run directory: torchrun's error files, hang dumps) is
reached through a directory handle the platform holds, one path component at a time, none of them
followed if it is a link (``openat`` with ``O_NOFOLLOW``), checked as a regular file on the open
handle (``fstat``, so a swap after the check changes nothing) and read to a bound.

Why not check the path, then open it: between an ``lstat()`` and an ``open()`` the run can put a
link where the file was; the platform (root, or the api's user) would then read its own secrets on
the run's behalf. Checking the handle that was opened leaves no such gap. ``O_NONBLOCK`` on the open
keeps a FIFO from blocking the reader; the regular-file check then refuses it, and devices too.

What this does not cover: a hard link to a platform file. The kernel refuses one to a user who
cannot read and write the file (``fs.protected_hardlinks = 1``, Debian's and most distributions'
default), which is what keeps the run user from linking the state dir's secrets."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFile(OSError):
    """What was found is not a regular file reached without links, or is larger than its bound."""


class NotRegular(UnsafeFile):
    """A FIFO, a device, a directory: opened without a link, but not a regular file."""


class TooLarge(UnsafeFile):
    """A regular file holding more than the bound it is read to."""


def _parts(relative: str) -> list[str]:
    parts = [p for p in relative.split("/") if p not in ("", ".")]
    if relative.startswith("/") or ".." in parts or not parts:
        raise UnsafeFile(f"{relative!r} is not a path beneath the directory")
    return parts


class RunDir:
    """A directory a run can write into, held open; everything beneath it is reached through it.

    ``RunDir.open(path)``: ``path``'s parent must be the platform's own (a run cannot replace
    ``path`` itself); ``path``, if it is a link, is refused."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def open(cls, path: Path | str) -> RunDir:
        try:
            return cls(os.open(path, DIR_FLAGS))
        except OSError as exc:
            raise _refused(exc, str(path)) from None

    def subdir(self, relative: str) -> RunDir:
        parts = _parts(relative)
        fd = os.dup(self.fd)
        for part in parts:
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _refused(exc, part) from None
            finally:
                os.close(fd)
            fd = child
        return RunDir(fd)

    def open_file(self, relative: str) -> int:
        """A descriptor of the regular file at ``relative``, opened for reading. UnsafeFile: a
        link on the way, or not a regular file; FileNotFoundError: nothing there."""
        *dirs, name = _parts(relative)
        parent = self.subdir("/".join(dirs)) if dirs else None
        try:
            return open_regular(name, parent.fd if parent else self.fd)
        finally:
            if parent is not None:
                parent.close()

    def read(self, relative: str, limit: int) -> bytes:
        """The whole file, which must hold at most ``limit`` bytes (UnsafeFile if it holds more)."""
        with os.fdopen(self.open_file(relative), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise TooLarge(f"{relative} is larger than {limit} bytes")
        return data

    def read_tail(self, relative: str, limit: int) -> bytes:
        """The file's last ``limit`` bytes at most (a log that may be of any size)."""
        with os.fdopen(self.open_file(relative), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - limit))
            return f.read(limit)

    def subdirs(self) -> list[str]:
        """The names of the directories directly inside (links to directories are not)."""
        with os.scandir(self.fd) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))

    def walk(self) -> Iterator[tuple[str, list[str], int]]:
        """(relative directory, its file names sorted, its descriptor) of every directory beneath,
        parents first, never through a link (``os.fwalk``, which checks each directory it enters
        is the one it listed). ``files`` names every non-directory: open them with
        :func:`open_regular` to keep only regular files."""
        for top, dirs, files, dir_fd in os.fwalk(".", dir_fd=self.fd, follow_symlinks=False):
            dirs.sort()
            yield ("" if top == "." else top.removeprefix("./")), sorted(files), dir_fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def open_regular(name: str, dir_fd: int) -> int:
    """``name`` (one component) in the directory ``dir_fd``, opened for reading if it is a regular
    file reached without a link; UnsafeFile otherwise (the descriptor closed)."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refused(exc, name) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegular(f"{name} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _refused(exc: OSError, name: str) -> OSError:
    """ELOOP (a link under O_NOFOLLOW) and ENOTDIR (a file or a link where a directory was asked)
    become UnsafeFile; the rest (FileNotFoundError above all) stay what they are."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return UnsafeFile(exc.errno, f"{name} is a link or not a directory: refused")
    return exc


def disk_usage(paths: list[Path], stop_above: int) -> int:
    """Bytes the files under ``paths`` take on disk (blocks, so a sparse file counts what it holds),
    never through a link; counting stops once past ``stop_above``."""
    used = 0
    for path in paths:
        with contextlib.suppress(OSError):
            for _top, _dirs, files, dir_fd in os.fwalk(path, follow_symlinks=False):
                for name in files:
                    with contextlib.suppress(OSError):
                        used += os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
                if used > stop_above:
                    return used
    return used
