"""What keeping torch's Flight Recorder costs every rank (``TORCH_FR_BUFFER_SIZE``, set by the worker
for the hang diagnosis), and what a hang dump costs when asked:

    python -m benchmarks.flight_recorder [--rounds 6] [--calls 3000]

The recorder is per process and read once, so the two variants run in separate processes, in
alternating rounds (off, on, on, off, ...: a drift cancels): each times ``--calls`` all-reduces of
16 floats on a one-rank Gloo group (no peer to wait for: the collective's own cost, the recorder's
included) and reports the least of 5 repeats in µs of the process's CPU time per call (all its
threads: on this shared 2-core machine wall time jitters by far more than the recorder costs). The recorder's cost per collective
is the median paired difference; a rank issues a few collectives per step (DDP: one per bucket),
against steps of milliseconds on Gloo. The dump (``workers/runtime/hangdump.dump``, with a full
recorder) is timed in the "on" processes: its time and its bytes once encoded."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from torchyard import hangdump
from torchyard.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def child(calls: int) -> None:
    import torch
    import torch.distributed as dist

    from workers.runtime import hangdump as rank_side

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    x = torch.ones(16)
    for _ in range(500):
        dist.all_reduce(x)
    best = float("inf")
    for _ in range(5):  # CPU time of the whole process (Gloo's threads too): other processes' load barely moves it
        t0 = time.process_time()
        for _ in range(calls):
            dist.all_reduce(x)
        best = min(best, (time.process_time() - t0) / calls * 1e6)
    t0 = time.perf_counter()
    raw = rank_side.encode(rank_side.dump("0" * 32, 0))
    dump_ms = (time.perf_counter() - t0) * 1e3
    print(json.dumps({"us_per_call": best, "dump_ms": dump_ms, "dump_bytes": len(raw)}), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown with Gloo's threads about (see workers/runtime/train.py's end)


def run(entries: int, calls: int) -> dict[str, float]:
    env = {**os.environ, hangdump.FR_BUFFER_ENV: str(entries), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.flight_recorder", "--child", "--calls", str(calls)],
        env=env, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(
            f"the timing process ({entries} entries) exited with {out.returncode}:\n{out.stderr[-3000:]}"
        )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--entries", type=int, default=Settings().fr_buffer_entries, help="the recorder's size when on")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.calls)
        return
    off: list[float] = []
    on: list[float] = []
    dumps: list[dict[str, float]] = []
    for i in range(args.rounds):
        order = (0, args.entries) if i % 2 == 0 else (args.entries, 0)
        for entries in order:
            result = run(entries, args.calls)
            (on if entries else off).append(result["us_per_call"])
            if entries:
                dumps.append(result)
    diffs = [b - a for a, b in zip(off, on, strict=True)]
    print(
        f"all_reduce of 16 floats, one-rank Gloo group, CPU µs, least of 5 × {args.calls} calls, {args.rounds} rounds"
    )
    print(f"  recorder off: median {statistics.median(off):.2f} µs/call  ({', '.join(f'{v:.2f}' for v in off)})")
    print(f"  recorder on ({args.entries} entries): median {statistics.median(on):.2f} µs/call")
    print(f"  the recorder's cost: median {statistics.median(diffs):.2f} µs per collective (paired)")
    print(
        f"  a hang dump with a full recorder: median {statistics.median(d['dump_ms'] for d in dumps):.1f} ms, "
        f"{statistics.median(d['dump_bytes'] for d in dumps) / 1024:.0f} KiB"
    )


if __name__ == "__main__":
    main()
