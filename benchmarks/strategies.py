"""Every strategy on charlm, 2 Gloo ranks, through the real entrypoint (torchrun + the SDK into a
private redis-server): one table of samples/s, comm fraction, bytes/step, busbw, final loss.

    python -m benchmarks.strategies [--steps 60] [--procs 2]

Per run: medians over steps 6..N (the first steps build buckets and warm up) of the per-rank
figures, averaged over ranks; final loss = mean of the last 5 steps' losses (over the ranks that
have one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis

from torchyard import streams
from torchyard.procs import RedisServer

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp/allreduce": {"kind": "ddp"},
    "ddp/fp16": {"kind": "ddp", "comm_hook": "fp16"},
    "ddp/bf16": {"kind": "ddp", "comm_hook": "bf16"},
    "ddp/powersgd r=4": {"kind": "ddp", "comm_hook": "powersgd", "powersgd_rank": 4, "powersgd_warmup": 5},
    "zero": {"kind": "zero"},
    "local_sgd H=4": {"kind": "local_sgd", "period": 4, "warmup_steps": 5},
    "fsdp": {"kind": "fsdp"},
    "fsdp no-reshard": {"kind": "fsdp", "reshard_after_forward": False},
    "pipeline gpipe": {"kind": "pipeline", "microbatches": 4, "schedule": "gpipe"},
    "pipeline 1f1b": {"kind": "pipeline", "microbatches": 4, "schedule": "1f1b"},
}
CHARLM = {
    "name": "charlm",
    "params": {"d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 64, "corpus_bytes": 500_000},
}


def run(server: RedisServer, run_id: int, strategy: dict[str, Any], steps: int, procs: int) -> dict[str, float]:
    spec = {
        "name": "bench",
        "workload": CHARLM,
        "strategy": strategy,
        "resources": {"procs_per_node": procs},
        "training": {"steps": steps, "batch_size": 32, "lr": 0.003, "seed": 0},
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_SPEC=json.dumps(spec), TORCHYARD_REDIS_URL=server.url, TORCHYARD_RUN_ID=str(run_id),
               TORCHYARD_ATTEMPT="1", OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
           "-m", "workers.runtime.train"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    client = redis.Redis.from_url(server.url)
    per_rank: dict[int, dict[int, dict[str, float]]] = {}
    entries: Any = client.xrange(streams.run_stream(run_id))
    for _id, fields in entries:
        kind, data = streams.decode(fields)
        if kind == streams.METRICS:
            for step, _ts, values in data["points"]:
                per_rank.setdefault(data["rank"], {})[step] = values
    client.close()

    def med(key: str) -> float:
        return statistics.fmean(
            statistics.median(v[key] for s, v in series.items() if s > 5) for series in per_rank.values()
        )

    losses = [
        statistics.fmean(series[s]["loss"] for s in range(steps - 4, steps + 1))
        for series in per_rank.values()
        if "loss" in series[steps]
    ]
    samples = sum(
        statistics.median(v["samples_per_s"] for s, v in series.items() if s > 5) for series in per_rank.values()
    )
    pipeline = strategy["kind"] == "pipeline"  # every rank sees the whole batch: count it once
    return {
        "samples_per_s": samples / procs if pipeline else samples,
        "comm_fraction": med("comm_fraction"),
        "comm_bytes": statistics.fmean(statistics.fmean(v["comm_bytes"] for s, v in series.items() if s > 5) for series in per_rank.values()),
        "busbw_GBps": med("busbw_GBps"),
        "busbw_efficiency": med("busbw_efficiency"),
        "loss": statistics.fmean(losses),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            print(f"charlm {CHARLM['params']}, {args.procs} ranks, batch 32, {args.steps} steps, Gloo/CPU")
            print(f"{'strategy':<18} {'samples/s':>9} {'comm frac':>9} {'bytes/step':>11} {'busbw GB/s':>10} "
                  f"{'busbw eff':>9} {'final loss':>10}")  # fmt: skip
            for i, name in enumerate(args.only):
                r = run(server, 1 + i, STRATEGIES[name], args.steps, args.procs)
                print(f"{name:<18} {r['samples_per_s']:9.1f} {r['comm_fraction']:9.2f} {r['comm_bytes']:11,.0f} "
                      f"{r['busbw_GBps']:10.3f} {r['busbw_efficiency']:9.2f} {r['loss']:10.3f}", flush=True)  # fmt: skip
        finally:
            server.stop()


if __name__ == "__main__":
    main()
