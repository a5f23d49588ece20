"""A rank's answer to "why is it stuck": a daemon thread that, when its worker asks (a request id in
the run directory's request file), writes a dump of the rank's Flight Recorder and of every
thread's Python stack (what a dump holds: ``torchyard/hangdump.py``).

Why a thread polling a file: the ranks cannot read Redis, and a Python signal handler runs in the
main thread only, the very one that is stuck. A collective's wait releases the GIL (measured on
Gloo: a blocking ``all_reduce``/``broadcast`` and DDP's backward), so this thread still runs while
the main one waits inside C++. A rank whose stuck thread holds the GIL (a C extension spinning with
it) cannot answer: the worker reports it as silent.

Started in every rank, by ``train.py`` for the built-in workloads and by ``autoinstrument.install``
for a user's script. It answers only in a process with a default process group, so data-loader
workers that inherit the environment stay quiet. Its cost: one ``stat`` every ``POLL_S``."""

from __future__ import annotations

import json
import linecache
import os
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

from torchyard import hangdump as contract

# Frames in these folders are the interpreter's or an installed package's, not the run's code.
_LIB_DIRS = tuple(
    sorted(
        {
            os.path.join(os.path.realpath(p), "")
            for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (p := sysconfig.get_paths().get(key))
        }
    )
)
_started = False


def start() -> None:
    """Starts the dump thread once per process (no-op outside a run: no ``TORCHYARD_RUN_DIR``)."""
    global _started
    run_dir = os.environ.get("TORCHYARD_RUN_DIR")
    if _started or not run_dir:
        return
    _started = True
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    threading.Thread(target=_serve, args=(Path(run_dir), local_rank), name="torchyard-hangdump", daemon=True).start()


def _serve(run_dir: Path, local_rank: int) -> None:
    request_file = run_dir / contract.REQUEST_FILE
    seen: tuple[int, int] | None = None
    answered = ""
    while True:
        time.sleep(contract.POLL_S)
        try:
            st = request_file.stat()
        except OSError:
            continue
        if (st.st_ino, st.st_mtime_ns) == seen or _distributed() is None:
            continue  # nothing new, or no process group yet (ask again next time)
        seen = (st.st_ino, st.st_mtime_ns)
        try:
            request = request_file.read_text()[:100].strip()
        except OSError:
            continue
        if request == answered or not contract.valid_request(request):
            continue
        answered = request
        try:
            write(run_dir / contract.dump_file(local_rank), dump(request, local_rank))
        except Exception as exc:  # never take the rank down; the worker reports it as silent
            sys.stderr.write(f"torchyard: could not write the hang dump ({type(exc).__name__}: {exc})\n")


def _distributed() -> Any:
    """torch.distributed with a default process group, else None (never imports torch itself)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def dump(request: str, local_rank: int) -> dict[str, Any]:
    """This rank's dump, within ``contract.MAX_DUMP_BYTES`` once encoded (see :func:`write`)."""
    dist = _distributed()
    out: dict[str, Any] = {
        "version": contract.VERSION,
        "request": request,
        "rank": int(os.environ.get("RANK", "-1")),
        "local_rank": local_rank,
        "world": int(os.environ.get("WORLD_SIZE", "0")),
        "pid": os.getpid(),
        "time": time.time(),
        "fr_buffer_size": int(os.environ.get(contract.FR_BUFFER_ENV, "0") or 0),
        "flight_recorder": None,
        "groups": {},
        "threads": threads(),
    }
    if dist is not None:
        out["rank"], out["world"] = dist.get_rank(), dist.get_world_size()
        out["flight_recorder"] = flight_recorder()
        out["flight_recorder_cuda"] = cuda_recorder(out["flight_recorder"])
        out["groups"] = groups(dist)
    return out


def flight_recorder(dump_name: str = "_dump_fr_trace_json") -> dict[str, Any] | None:
    """One of torch's Flight Recorders as JSON, its newest ``MAX_ENTRIES`` entries; None when this
    build has none of that name (``_dump_nccl_trace_json``: CUDA builds only)."""
    try:
        import torch._C._distributed_c10d as c10d

        dump_json = getattr(c10d, dump_name, None)
        if dump_json is None:
            return None
        raw: dict[str, Any] = json.loads(dump_json(includeCollectives=True, onlyActive=False))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    entries = raw.get("entries") or []
    raw["entries"] = entries[-contract.MAX_ENTRIES :]
    raw["entries_cut"] = len(entries) - len(raw["entries"])
    return raw


def cuda_recorder(cpu: dict[str, Any] | None) -> dict[str, Any] | None:
    """NCCL's recorder (CUDA builds keep it apart from Gloo's), unless it is the same ring."""
    cuda = flight_recorder("_dump_nccl_trace_json")
    if cuda is None or cpu is None:
        return cuda

    def ids(recorder: dict[str, Any]) -> list[Any]:
        return [(e.get("pg_id"), e.get("record_id")) for e in recorder.get("entries") or []]

    return None if ids(cuda) == ids(cpu) else cuda


def groups(dist: Any) -> dict[str, dict[str, Any]]:
    """Each process group this rank knows: its description and its members' global ranks."""
    out: dict[str, dict[str, Any]] = {}
    world = dist.distributed_c10d._world
    for pg, name in list(world.pg_names.items())[:256]:
        try:
            ranks = dist.get_process_group_ranks(pg)
        except Exception:
            ranks = []
        out[str(name)] = {"desc": str(getattr(pg, "group_desc", ""))[:100], "ranks": sorted(int(r) for r in ranks)}
    return out


def threads() -> list[dict[str, Any]]:
    """Every Python thread's stack (this one's left out), the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    out: list[dict[str, Any]] = []
    for ident, top in sys._current_frames().items():
        if ident == me:
            continue
        frames: list[dict[str, Any]] = []
        cut = 0
        frame: Any = top
        while frame is not None:
            if len(frames) < contract.MAX_FRAMES:
                frames.append(_frame(frame))
            else:
                cut += 1
            frame = frame.f_back
        frames.reverse()  # outermost first, as a traceback reads
        out.append({"id": ident, "name": names.get(ident, "?"), "main": ident == main, "frames": frames, "cut": cut})
    out.sort(key=lambda t: not t["main"])
    return out[: contract.MAX_THREADS]


def _frame(frame: Any) -> dict[str, Any]:
    file, line = frame.f_code.co_filename, frame.f_lineno or 0
    return {
        "file": file,
        "line": line,
        "func": frame.f_code.co_name,
        "code": linecache.getline(file, line).strip()[: contract.MAX_CODE_CHARS],
        "lib": file.startswith("<") or os.path.realpath(file).startswith(_LIB_DIRS),
    }


def encode(data: dict[str, Any]) -> bytes:
    """The dump as JSON within ``MAX_DUMP_BYTES``: the oldest recorder entries go first, then the
    outer frames, then threads, until it fits."""
    while True:
        raw = json.dumps(data, separators=(",", ":"), default=str).encode()
        if len(raw) <= contract.MAX_DUMP_BYTES:
            return raw
        recorders = [r for r in (data.get("flight_recorder"), data.get("flight_recorder_cuda")) if r]
        stacks = data["threads"]
        longest: dict[str, Any] = max(recorders, key=lambda r: len(r.get("entries") or []), default={})
        if len(longest.get("entries") or []) > 8:
            half = len(longest["entries"]) // 2
            longest["entries_cut"] = longest.get("entries_cut", 0) + half
            longest["entries"] = longest["entries"][half:]
        elif any(len(t["frames"]) > 8 for t in stacks):
            for t in stacks:
                t["cut"] += max(0, len(t["frames"]) - 8)
                t["frames"] = t["frames"][-8:]
        elif len(stacks) > 1:
            data["threads"] = stacks[: len(stacks) // 2]
        else:  # a recorder or groups this large are not worth a partial dump
            small = {
                k: v
                for k, v in data.items()
                if k not in ("flight_recorder", "flight_recorder_cuda", "groups", "threads")
            }
            return json.dumps({**small, "error": "the dump did not fit in its bound"}).encode()


def write(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: the worker never reads half a dump."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(encode(data))
    os.replace(tmp, path)
