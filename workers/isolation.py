"""The rank wall on the node: a worker running as root runs every run's torchrun tree as an
unprivileged user (``TORCHYARD_RUN_USER``) in a PID and mount namespace of its own.

Why one run user plus a PID namespace per run, not a user per run: the user takes away the
platform's files (state dir, secrets, database, installed code are root's and not writable, the
state dir not even visible) and any signal to root's processes; the PID namespace takes away the
rest: a run sees (``/proc``) and can signal only its own processes, so it cannot kill or read the
environment of another run's ranks although they share the uid. It needs no uid range, no
``/etc/passwd`` entry per run and nothing to clean up: the namespace ends with its torchrun.
(Another run's run directory is out of sight too: see :func:`_mount_script`.)

Measured here (Debian 12, util-linux 2.38): ``unshare --pid --fork --mount-proc`` and ``setpriv
--reuid --regid --clear-groups --no-new-privs`` work as root; ``unshare --fork`` leaves SIGTERM to
its child and exits with the child's status, so the launcher's process-group teardown and exit
codes are unchanged.

The mount namespace also answers a practical problem: the interpreter may live where the run user
cannot reach it (here ``/root/.pyenv``, ``/root`` being 0700), as may the run directory (a 0700
state dir, pytest's 0700 temp dirs). Rather than loosening those on the host, the namespace covers
each such hidden directory with an empty tmpfs and binds back only the paths the run needs, so
the ranks see the interpreter, the installed code, their run directory and their checkpoints, and
nothing else of what was hidden (not the state dir, not another run's directory).

Temp space is the run's own: runs share one uid, so a world-writable ``/tmp`` would let one run read
another's temp files. Each namespace mounts a fresh tmpfs on ``/tmp`` (``/var/tmp`` is the same
one) and another on ``/dev/shm`` (DataLoader workers' and NCCL's shared memory), each bounded
(``TORCHYARD_RUN_TMP_BYTES``, ``..._RUN_SHM_BYTES``). A tmpfs rather than a folder of the run
directory: it ends with the namespace's last process (a worker killed with -9 leaves nothing on
disk), its size is a hard bound, and it needs no room on the state dir's disk."""

from __future__ import annotations

import logging
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunUser:
    name: str
    uid: int
    gid: int


def isolating() -> bool:
    """Ranks are walled off only when the worker can drop to another user: it runs as root."""
    return os.geteuid() == 0


def ensure_run_user(name: str) -> RunUser:
    """The run user, created (a system user: no home, no login shell) when absent."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        nologin = shutil.which("nologin") or "/usr/sbin/nologin"
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell", nologin, name],
            check=True,
            capture_output=True,
        )
        log.info("created the run user %s", name)
        entry = pwd.getpwnam(name)
    if entry.pw_uid == 0:
        raise RuntimeError(f"TORCHYARD_RUN_USER={name} is root: ranks must run unprivileged")
    return RunUser(name, entry.pw_uid, entry.pw_gid)


def give(path: Path, user: RunUser, platform_group: int | None = None) -> None:
    """Hands a run's directory (and everything in it) to the run user: private to it, or readable
    by ``platform_group`` too (setgid: what the ranks make there is the group's, and their umask
    leaves it group-readable). Checkpoints are shared so: the api serves them, and in docker-compose
    it runs as the image's user, not as the root worker (README "docker-compose")."""
    gid = user.gid if platform_group is None else platform_group
    # Through directory handles, never a link: what is in there may be an earlier attempt's, whose
    # ranks could swap a directory for a link to the platform's files while it is walked.
    for _top, dirs, files, dir_fd in os.fwalk(path, follow_symlinks=False):
        for name in (*dirs, *files):
            os.chown(name, user.uid, gid, dir_fd=dir_fd, follow_symlinks=False)
    os.chown(path, user.uid, gid, follow_symlinks=False)
    path.chmod(0o700 if platform_group is None else 0o2750)


def open_to_group(directory: Path, group: int) -> None:
    """A platform directory on the way to what :func:`give` shares with ``group``: enterable by it."""
    os.chown(directory, -1, group)
    directory.chmod(0o750)


def interpreter_paths() -> list[Path]:
    """What a rank's Python needs to start: the interpreter's prefixes and library folders."""
    paths = {sys.prefix, sys.base_prefix, os.path.dirname(sys.executable)}
    paths.update(p for p in sysconfig.get_paths().values() if p)
    return [Path(os.path.realpath(p)) for p in paths if os.path.isdir(p)]


@dataclass(frozen=True)
class TempSpace:
    """Bounds of a run's private temp file systems, in bytes."""

    tmp_bytes: int
    shm_bytes: int


TMP, VAR_TMP, SHM = Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")
SLOTS = ".torchyard-mounts"  # in the run's new /tmp: where needed paths wait while what hid them is mounted


def wrap(
    command: list[str],
    user: RunUser,
    needed: list[Path],
    stash: Path,
    temp: TempSpace,
    readonly: list[Path] | tuple[Path, ...] = (),
) -> list[str]:
    """``command`` as the run user in a PID and mount namespace of its own (see the module);
    ``readonly`` paths are reachable too, through read-only binds (a dataset's shards)."""
    script = _mount_script(user, [*needed, *readonly], stash, temp, readonly)
    setpriv = [
        "setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--no-new-privs", "--",
    ]  # fmt: skip
    # --kill-child: if unshare itself is killed, its namespace's init goes too (and with it every rank).
    return [
        "unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private", "--kill-child",
        "/bin/sh", "-c", f"{script}exec {shlex.join(setpriv)} \"$@\"", "torchyard-run", *command,
    ]  # fmt: skip


def _mount_script(
    user: RunUser, needed: list[Path], stash: Path, temp: TempSpace, readonly: list[Path] | tuple[Path, ...] = ()
) -> str:
    """Shell lines, run as root inside the new mount namespace before dropping to the run user.

    The run's /tmp is first mounted on ``stash`` (an empty folder of the worker's), and each needed
    path that is about to be hidden is bound into it: those under /tmp or /var/tmp, and those
    under the topmost directory on their way that the run user cannot enter. The tmpfs then moves
    onto /tmp (taking those bindings along), each such closed directory is covered by an empty
    tmpfs (0711: searchable, to reach what is bound there, not listable), and each needed path
    moves back in place."""
    needed = _outermost(needed)
    for path in needed:
        if any(path == p or p.is_relative_to(path) for p in (TMP, VAR_TMP, SHM, stash)):
            raise RuntimeError(f"{path} holds the run's temp space or the mount stash: it cannot be bound whole")
    hidden = {path: top for path in needed if (top := _cover(path, user)) is not None}
    slots = [(TMP / SLOTS / str(n), stash / SLOTS / str(n), path) for n, path in enumerate(sorted(hidden))]
    q = shlex.quote
    lines = ["set -e", "umask 066"]  # mount points made in a tmpfs: searchable, not listable
    lines.append(f"mount -t tmpfs -o mode=1777,size={temp.tmp_bytes},nosuid,nodev torchyard-tmp {q(str(stash))}")
    for _, waiting, path in slots:
        lines += [f"mkdir -p {q(str(waiting))}", f"mount --rbind {q(str(path))} {q(str(waiting))}"]
    lines.append(f"mount --move {q(str(stash))} {TMP}")
    if VAR_TMP.is_dir():
        lines.append(f"mount --bind {TMP} {VAR_TMP}")
    for top in sorted(set(hidden.values()) - {TMP, VAR_TMP}):
        lines.append(f"mount -t tmpfs -o mode=0711,size=1m torchyard-wall {q(str(top))}")
    for slot, _, path in slots:
        lines += [f"mkdir -p {q(str(path))}", f"mount --move {q(str(slot))} {q(str(path))}", f"rmdir {q(str(slot))}"]
    if slots:
        lines.append(f"rmdir {TMP / SLOTS}")
    if SHM.is_dir():
        lines.append(f"mount -t tmpfs -o mode=1777,size={temp.shm_bytes},nosuid,nodev torchyard-shm {SHM}")
    for path in readonly:  # a bind of its own (a no-op where it is one already), then made read-only
        lines += [f"mount --bind {q(str(path))} {q(str(path))}", f"mount -o remount,bind,ro {q(str(path))}"]
    # The ranks' files: theirs and their group's, which is the run user's own, but in the checkpoint
    # directory the platform's (give()): the api reads checkpoints, nothing else of a run.
    lines.append("umask 027")
    return "; ".join(lines) + "; "


def _outermost(paths: list[Path]) -> list[Path]:
    """The paths that are not inside another of them (binding the outer one brings the inner)."""
    unique = sorted(set(paths), key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in unique:
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept


def _cover(path: Path, user: RunUser) -> Path | None:
    """What hides ``path`` from the ranks once mounted: the run's /tmp (or /var/tmp) when it is in
    there, else the highest directory on its way the run user cannot enter; None: nothing."""
    return next((t for t in (TMP, VAR_TMP) if path.is_relative_to(t)), None) or _topmost_closed(path, user)


def _topmost_closed(path: Path, user: RunUser) -> Path | None:
    """The highest directory on the way to ``path`` (``path`` excluded) the run user cannot search."""
    for ancestor in reversed(path.parents):
        if not _searchable(ancestor, user):
            return ancestor
    return None


def _searchable(directory: Path, user: RunUser) -> bool:
    st = directory.stat()
    if st.st_uid == user.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == user.gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)
