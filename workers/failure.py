"""Why a share failed, in the order a user reads it: the first failing rank's own exception (type
and message, the rank, where in their code, the last frames), then torchrun's one-line summary.
Torchrun's own report says only ``ChildFailedError`` and "To enable traceback see ..." unless the
script used ``@record``.

Where the exception comes from, best first:

1. the ranks' error files (``TORCHELASTIC_ERROR_FILE``, which every rank writes through
   ``workers/runtime/errorfile.py``, or torch's ``@record``), under torchrun's ``--log-dir`` as
   ``<run>/attempt_<round>/<local rank>/error.json``: of the last restart round's files, the first
   written is the first failure (a peer's error follows it: its collective lost the failed rank);
2. the first traceback a rank printed (``LogPump.rank_traceback``): a rank that failed before its
   hook was installed, e.g. at import;
3. the last lines of output."""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from torchyard.runfiles import RunDir

ERROR_FILE = "error.json"
MAX_ERROR_FILE = 1 << 20  # bytes: torch writes a message and a traceback; a larger file is not its
FRAMES = 8  # the innermost frames of the traceback kept in the reason
FRAME = re.compile(r'^\s*File "(?P<path>.+)", line (?P<line>\d+), in (?P<func>.+)$')
TRACEBACK_START = "Traceback (most recent call last):"
FAILED = re.compile(r"^(\S.*) FAILED$")  # torchrun's ChildFailedError report: "train.py FAILED", then
ROOT_FIELD = re.compile(r"^\s+(rank|exitcode)\s+: (.*?)\s*$")  # "Root Cause (first observed failure):" fields


@dataclass(frozen=True)
class RankError:
    message: str  # "ValueError: bad shard 7"
    rank: str  # the global rank, or "local rank N" when the file does not say
    callstack: str  # the formatted traceback


def describe(
    returncode: int, log_dir: Path, roots: list[Path], rank_traceback: list[str], agent_tail: list[str], tail: list[str]
) -> str:
    """The failure reason of a share whose torchrun exited with ``returncode`` (not 0). ``roots``:
    where the run's own code lives (a script's unpacked bundle, or this checkout for a built-in
    workload): paths are shown relative to them, and the frame named is the innermost one there."""
    summary = torchrun_summary(returncode, agent_tail)
    first = first_error(log_dir)
    if first is not None:
        frames = _last_frames(_relative(first.callstack, roots).splitlines())
        where = _where(frames)
        lines = [first.message, f"on rank {first.rank}" + (f" {where}" if where else ""), *frames, summary]
    elif rank_traceback:
        lines = [*rank_traceback, summary]
    else:
        lines = [summary, *tail[-20:]]
    return _relative("\n".join(lines), roots)


def first_error(log_dir: Path) -> RankError | None:
    """The first error file written in torchrun's last restart round, read. The ranks can write
    there: nothing is followed through a link, and a file that is not regular or is larger than
    ``MAX_ERROR_FILE`` is passed over (the reason then comes from the rank's printed traceback)."""
    try:
        logs = RunDir.open(log_dir)
    except OSError:
        return None
    with logs:
        try:
            found = _error_files(logs)
        except OSError:  # a directory swapped for a link while it was listed: the run's own doing
            found = []
        last_round = max((r for r, _, _ in found), default=None)
        for _, _, relative in sorted(f for f in found if f[0] == last_round):
            if (error := _read(logs, relative)) is not None:
                return error
    return None


def _error_files(logs: RunDir) -> list[tuple[int, int, str]]:
    """(restart round, written at (ns), path) of each ``<run>/attempt_<round>/<local rank>/error.json``."""
    found = []
    for name in logs.subdirs():
        with logs.subdir(name) as run:
            for attempt in run.subdirs():
                restart_round = attempt.removeprefix("attempt_")
                if attempt == restart_round or not restart_round.isdigit():
                    continue
                with run.subdir(attempt) as rounds:
                    for local in rounds.subdirs():
                        try:
                            info = os.stat(f"{local}/{ERROR_FILE}", dir_fd=rounds.fd, follow_symlinks=False)
                        except OSError:
                            continue
                        found.append((int(restart_round), info.st_mtime_ns, f"{name}/{attempt}/{local}/{ERROR_FILE}"))
    return found


def _read(logs: RunDir, relative: str) -> RankError | None:
    try:
        message = json.loads(logs.read(relative, MAX_ERROR_FILE).decode(errors="replace"))["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    local = f"local rank {relative.split('/')[-2]}"
    if isinstance(message, str):  # torch's other format: the message alone
        return RankError(message, local, "")
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    rank = str(extra.get("rank") or "") or local
    return RankError(str(message.get("message", "")), rank, str(extra.get("py_callstack", "")))


def _last_frames(lines: list[str]) -> list[str]:
    """The last traceback of the chain (the exception that ended the rank), its innermost frames,
    without the closing exception line(s) (the reason's first line says them)."""
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_START)]
    if not starts:
        return []
    body = lines[starts[-1] + 1 :]
    frame_at = [i for i, line in enumerate(body) if FRAME.match(line)]
    if not frame_at:
        return []
    end = frame_at[-1] + 1
    while end < len(body) and body[end].startswith("    "):  # the frame's source line and its ^^^ marks
        end += 1
    kept = frame_at[-FRAMES:]
    skipped = len(frame_at) - len(kept)
    header = TRACEBACK_START if not skipped else f"Traceback (most recent call last, the last {FRAMES} frames):"
    return [header, *body[kept[0] : end]]


def _where(frames: list[str]) -> str:
    """``at train.py line 5, in load``: the innermost frame in the run's own code (its paths are
    relative by now), else the innermost."""
    matches = [m for m in (FRAME.match(line) for line in frames) if m]
    if not matches:
        return ""
    own = [m for m in matches if not m["path"].startswith(("/", "<"))]
    m = (own or matches)[-1]
    return f"at {m['path']} line {m['line']}, in {m['func']}"


def _relative(text: str, roots: list[Path]) -> str:
    for root in roots:
        text = text.replace(f"{root}/", "")
    return text


def torchrun_summary(returncode: int, agent_tail: list[str]) -> str:
    """One line: how torchrun ended and, from its own report, the rank it saw fail first."""
    how = f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"
    failed = [m[1] for m in map(FAILED.match, agent_tail) if m]
    if not failed:
        return f"torchrun exited with {how}"
    root_at = [i for i, line in enumerate(agent_tail) if line.startswith("Root Cause")]
    root = agent_tail[root_at[-1] :] if root_at else []
    fields = {m[1]: m[2] for m in map(ROOT_FIELD.match, root) if m}
    code = (fields.get("exitcode") or "?").split()[0]  # "1 (pid: 4242)"
    cause = f"; root cause: rank {fields['rank']}, exitcode {code}" if "rank" in fields else ""
    return f"torchrun: {failed[-1]} FAILED ({how}{cause})"
