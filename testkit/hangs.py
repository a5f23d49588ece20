"""Hung runs without the platform: the rank entrypoint under the real torch elastic launcher with
the ``fail`` workload hanging one way (``workers/runtime/hangs.py``), its ranks asked for their hang
dumps as a worker asks them (``workers/diagnose.py``). Records the fixtures the comparison's unit
tests read (``tests/fixtures/diagnosis``):

    python -m testkit.hangs tests/fixtures/diagnosis
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from cli.wait import wait_for
from torchyard import hangdump
from workers import proctree
from workers.code import INJECT_DIR
from workers.diagnose import collect

ROOT = Path(__file__).resolve().parents[1]
# (fixture name, hang_in, ranks, the rank that hangs: None for every rank)
CASES = [
    ("skip_collective_3", "skip_collective", 3, 1),
    ("skip_collective_2", "skip_collective", 2, 1),
    ("other_collective_2", "other_collective", 2, 1),
    ("data_loading_2", "data_loading", 2, 1),
    ("python_3", "python", 3, 2),
    ("python_all_2", "python", 2, None),
]


def fail_spec(hang_in: str, procs: int, rank: int | None, at_step: int = 4) -> dict[str, Any]:
    params: dict[str, Any] = {"at_step": at_step, "hang": True, "hang_in": hang_in}
    if rank is not None:
        params["rank"] = rank
    return {
        "name": f"hang-{hang_in}",
        "workload": {"kind": "builtin", "name": "fail", "params": params},
        "strategy": {"kind": "ddp"},
        "resources": {"procs_per_node": procs, "device": "cpu"},
        "training": {"steps": 20, "batch_size": 12 * procs, "lr": 0.01, "seed": 0},
    }


def hung_dumps(
    run_dir: Path, spec: dict[str, Any], script: Path | None = None, timeout: float = 90
) -> list[dict[str, Any]]:
    """Launches the spec's ranks (the built-in entrypoint, or ``script`` instrumented as the launcher
    instruments a user's script), waits until their dumps stop changing (the hang is reached: the
    same pending collectives and innermost frames three times running) and returns them."""
    procs = spec["resources"]["procs_per_node"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(
        TORCHYARD_SPEC=json.dumps(spec),
        TORCHYARD_RUN_ID="1",
        TORCHYARD_ATTEMPT="1",
        TORCHYARD_RUN_DIR=str(run_dir),
        TORCHYARD_RANK_REDIS_URL="redis://127.0.0.1:9/0",  # nowhere: the points are not the point
        TORCHYARD_SDK_EXIT_FLUSH_S="0",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        **{hangdump.FR_BUFFER_ENV: str(hangdump.MAX_ENTRIES)},
    )
    target = ["-m", "workers.runtime.train"]
    if script is not None:
        env.update(PYTHONPATH=os.pathsep.join((str(INJECT_DIR), str(ROOT))), TORCHYARD_INSTRUMENT="1")
        target = [str(script)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(procs), *target]  # fmt: skip
    with open(run_dir / "output.log", "wb") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        seen: list[Any] = []

        def settled() -> list[dict[str, Any]] | None:
            dumps, _missing = collect(run_dir, procs, uuid.uuid4().hex, wait_s=2.0)
            seen.append([_where(d) for d in dumps] if len(dumps) == procs else None)
            stuck = len(seen) >= 3 and seen[-1] is not None and seen[-1] == seen[-2] == seen[-3]
            return dumps if stuck else None

        return wait_for(settled, timeout, f"the ranks of {spec['name']} to hang", interval=0.3)
    finally:
        proctree.end_process_group(proc.pid, 1.0)  # ranks sit in sessions of their own: the whole tree


def _where(dump: dict[str, Any]) -> Any:
    entries = (dump.get("flight_recorder") or {}).get("entries") or []
    pending = [(e["process_group"][0], e["collective_seq_id"]) for e in entries if not e["retired"]]
    frames = dump["threads"][0]["frames"] if dump["threads"] else []
    return pending, [(f["file"], f["line"]) for f in frames[-3:]]


def small(dump: dict[str, Any], entries: int = 12) -> dict[str, Any]:
    """A fixture's copy: the newest recorder entries only (the rest is the same all-reduce again)."""
    recorder = dict(dump["flight_recorder"])
    recorder["entries_cut"] += max(0, len(recorder["entries"]) - entries)
    recorder["entries"] = recorder["entries"][-entries:]
    return {**dump, "flight_recorder": recorder}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, hang_in, procs, rank in CASES:
        run_dir = out / f".run-{name}"
        run_dir.mkdir(exist_ok=True)
        try:
            dumps = hung_dumps(run_dir, fail_spec(hang_in, procs, rank))
        finally:
            for path in run_dir.iterdir():
                path.unlink()
            run_dir.rmdir()
        fixture = {"spec": fail_spec(hang_in, procs, rank), "dumps": [small(d) for d in dumps]}
        (out / f"{name}.json").write_text(json.dumps(fixture, indent=1) + "\n")
        print(f"{name}: {len(dumps)} dumps")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
