"""Per-run caps the kernel enforces: one control group per share for processes (``pids``) and
memory, made under the worker's own group (so a run never escapes what the worker itself is held
to), entered by the share's first process before anything of the run starts, read afterwards for
what was hit, and emptied and removed when the share ends, however it ends.

Why a control group and not ``RLIMIT_NPROC``: every run shares one run user, and RLIMIT_NPROC
counts the user's processes on the whole host, so one run's fork bomb would stop every other run
(and a second stack's) at the same bound. A ``pids`` group counts only its own run's tasks
(processes and threads alike: a rank of torch has a few dozen threads), and its memory group makes
the kernel's OOM killer pick from the run's processes only.

Both hierarchies are supported: cgroup v2 (``memory.max``, ``pids.max``, ``*.events``) where the
worker's group may delegate the two controllers, and v1 (``memory.limit_in_bytes``,
``memory.oom_control``), which this machine has. Where neither can be written (a worker that is
not root, a v2 group without delegation) :func:`support` says why: ``torchyard up`` and the node's
page show it, and the run is held only to the watched bounds (disk: ``workers/launcher.py``)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "memory")
PARENT = "torchyard-runs"  # under the worker's own group: every share's group lives here


@dataclass(frozen=True)
class Caps:
    """What a share may take on its node; 0: not capped."""

    pids: int
    memory_bytes: int


@dataclass(frozen=True)
class _Layout:
    version: int  # 1 or 2
    dirs: dict[str, Path]  # controller -> the worker's own group's directory


def _own_groups() -> dict[str, str]:
    """controller (or "" for v2) -> this process's group path, from /proc/self/cgroup."""
    groups = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            groups[name] = path
    return groups


def _layout() -> _Layout | str:
    """Where the worker may make its runs' groups, or why it may not."""
    if os.geteuid() != 0:
        return "the worker is not root"
    try:
        groups = _own_groups()
    except OSError as exc:
        return f"/proc/self/cgroup cannot be read ({exc.strerror})"
    v1 = {c: CGROUP_ROOT / c / groups[c].lstrip("/") for c in CONTROLLERS if c in groups}
    if len(v1) == len(CONTROLLERS) and all((d / "cgroup.procs").exists() for d in v1.values()):
        return _Layout(1, v1)
    unified = CGROUP_ROOT / groups.get("", "/").lstrip("/")
    if "" in groups and (unified / "cgroup.controllers").exists():
        available = (unified / "cgroup.controllers").read_text().split()
        missing = [c for c in CONTROLLERS if c not in available]
        if missing:
            return f"cgroup v2 does not delegate {', '.join(missing)} to the worker's group ({unified})"
        return _Layout(2, {c: unified for c in CONTROLLERS})
    return "no cgroup v1 pids and memory hierarchies and no cgroup v2 with them are mounted"


def support() -> str:
    """One line: how runs are capped on this host (shown at ``up`` and on the node's page)."""
    layout = _layout()
    if isinstance(layout, str):
        return f"processes and memory are not capped by the kernel: {layout}"
    return f"processes and memory capped per run by cgroup v{layout.version}"


class RunGroup:
    """One share's control group(s), with ``caps`` written; see the module."""

    def __init__(self, layout: _Layout, name: str, caps: Caps) -> None:
        self.layout, self.caps = layout, caps
        self.dirs = {c: d / PARENT / name for c, d in layout.dirs.items()}
        for directory in self.dirs.values():
            if layout.version == 2:
                _enable_controllers(directory.parent)
            directory.mkdir(parents=True, exist_ok=True)
        if caps.pids:
            self._write("pids", "pids.max", caps.pids)
        if caps.memory_bytes:
            if layout.version == 2:
                self._write("memory", "memory.max", caps.memory_bytes)
                self._write("memory", "memory.swap.max", 0, optional=True)
            else:
                self._write("memory", "memory.limit_in_bytes", caps.memory_bytes)
                self._write("memory", "memory.memsw.limit_in_bytes", caps.memory_bytes, optional=True)

    @classmethod
    def create(cls, run_id: int, attempt: int, caps: Caps) -> RunGroup | None:
        """The share's group, or None where the host cannot make one (logged once per share)."""
        layout = _layout()
        if isinstance(layout, str):
            log.info("run %s: %s", run_id, support())
            return None
        name = f"run-{run_id}-attempt-{attempt}-{uuid.uuid4().hex[:8]}"  # two stacks on a host never meet
        try:
            return cls(layout, name, caps)
        except OSError as exc:
            log.warning("run %s: no control group (%s): processes and memory not capped", run_id, exc)
            return None

    def _write(self, controller: str, file: str, value: int, optional: bool = False) -> None:
        try:
            (self.dirs[controller] / file).write_text(str(value))
        except OSError:
            if not optional:
                raise

    def enter(self, command: list[str]) -> list[str]:
        """``command``, started from a shell that first moves itself into the group: whatever it
        becomes and starts is in the group from its first instruction."""
        procs = [str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]
        writes = "".join(f'echo $$ > "${i + 1}" && ' for i in range(len(procs)))
        return ["/bin/sh", "-c", f'{writes}shift {len(procs)} && exec "$@"', "torchyard-caps", *procs, *command]

    def breaches(self) -> list[str]:
        """What the share ran into, as the failure reason says it: its process cap (forks
        refused) and its memory cap (a process killed by the OOM killer)."""
        found = []
        refused = self._count("pids", "pids.events", "max")
        if refused:
            found.append(
                f"the run reached its cap of {self.caps.pids} processes and threads (TORCHYARD_RUN_MAX_PIDS): "
                f"{refused} fork(s) refused"
            )
        killed = self._count(
            "memory", "memory.events" if self.layout.version == 2 else "memory.oom_control", "oom_kill"
        )
        if killed:
            found.append(
                f"the run passed its memory cap of {self.caps.memory_bytes / 2**20:,.0f} MiB "
                f"(resources.memory_limit_bytes, TORCHYARD_RUN_MAX_MEMORY_BYTES): {killed} process(es) killed"
            )
        return found

    def _count(self, controller: str, file: str, key: str) -> int:
        try:
            text = (self.dirs[controller] / file).read_text()
        except OSError:
            return 0
        match = re.search(rf"^{key} (\d+)$", text, re.MULTILINE)
        return int(match[1]) if match else 0

    def remove(self) -> None:
        remove_groups(list(self.dirs.values()))


def remove_groups(dirs: list[Path]) -> None:
    """Every process still in the groups is killed (a rank's child that left the process group and
    the session), then the groups go. Also for a share a killed worker left (its record keeps them)."""
    for directory in dict.fromkeys(dirs):
        for _ in range(100):
            try:
                pids = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)  # SIGKILL is delivered at once; the kernel takes the tasks out as they exit
    for directory in dirs:
        with contextlib.suppress(OSError):
            directory.rmdir()


def _enable_controllers(parent: Path) -> None:
    """cgroup v2: the controllers on for the worker's group's children (a no-op where they are)."""
    parent.mkdir(exist_ok=True)
    for group in (parent.parent, parent):
        control = group / "cgroup.subtree_control"
        on = set(control.read_text().split())
        for controller in CONTROLLERS:
            if controller not in on:
                control.write_text(f"+{controller}")
