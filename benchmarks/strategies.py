"""Every strategy on charlm, 2 Gloo ranks, through the real entrypoint (torchrun + the SDK into a
private redis-server): one table of samples/s, comm fraction, bytes/step, busbw, each rank's share
of the parameters, peak RSS, final loss. A strategy the spec refuses at ``--procs`` is skipped.

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
from pydantic import ValidationError

from cli.redis_server import RedisServer
from torchyard import streams
from torchyard.spec import RunSpec

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
    "tp": {"kind": "tp"},
    "tp no-sp": {"kind": "tp", "sequence_parallel": False},
    "fsdp_tp": {"kind": "fsdp_tp", "tp_degree": 2},  # 2-D: at least 4 ranks
}


def refusal(spec: dict[str, Any]) -> str | None:
    """Why the spec cannot run (a strategy needing more ranks, ...), or None: the spec's own rules."""
    try:
        RunSpec.model_validate(spec)
    except ValidationError as exc:
        return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
    return None


def readers_per_shard(strategy: dict[str, Any], procs: int) -> int:
    """How many ranks read (and report) the same samples: every stage of a pipeline, every rank of a
    TP group."""
    return {"pipeline": procs, "tp": procs, "fsdp_tp": int(strategy.get("tp_degree", 2))}.get(strategy["kind"], 1)


CHARLM = {
    "name": "charlm",
    "params": {"d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 64, "corpus_bytes": 500_000},
}


def bench_spec(strategy: dict[str, Any], steps: int, procs: int) -> dict[str, Any]:
    return {
        "name": "bench",
        "workload": CHARLM,
        "strategy": strategy,
        "resources": {"procs_per_node": procs},
        "training": {"steps": steps, "batch_size": 32, "lr": 0.003, "seed": 0},
    }


def run(server: RedisServer, run_id: int, strategy: dict[str, Any], steps: int, procs: int) -> dict[str, float]:
    spec = bench_spec(strategy, steps, procs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_SPEC=json.dumps(spec), TORCHYARD_RANK_REDIS_URL=server.url, TORCHYARD_RUN_ID=str(run_id),
               TORCHYARD_ATTEMPT="1", OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
           "-m", "workers.runtime.train"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    client = redis.Redis.from_url(server.url)
    per_rank: dict[int, dict[int, dict[str, float]]] = {}
    entries: Any = client.xrange(streams.rank_stream(run_id))
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
    return {  # ranks that read the same samples count them once
        "samples_per_s": samples / readers_per_shard(strategy, procs),
        "comm_fraction": med("comm_fraction"),
        "comm_bytes": statistics.fmean(statistics.fmean(v["comm_bytes"] for s, v in series.items() if s > 5) for series in per_rank.values()),
        "busbw_GBps": med("busbw_GBps"),
        "busbw_efficiency": med("busbw_efficiency"),
        "param_bytes": med("param_bytes"),  # this rank's share of the model (mean over ranks)
        "max_rss_bytes": max(max(v["max_rss_bytes"] for v in series.values()) for series in per_rank.values()),
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
                  f"{'busbw eff':>9} {'params/rank':>11} {'peak RSS':>9} {'final loss':>10}")  # fmt: skip
            for i, name in enumerate(args.only):
                if why := refusal(bench_spec(STRATEGIES[name], args.steps, args.procs)):
                    print(f"{name:<18} skipped: {why}", flush=True)
                    continue
                r = run(server, 1 + i, STRATEGIES[name], args.steps, args.procs)
                print(f"{name:<18} {r['samples_per_s']:9.1f} {r['comm_fraction']:9.2f} {r['comm_bytes']:11,.0f} "
                      f"{r['busbw_GBps']:10.3f} {r['busbw_efficiency']:9.2f} {r['param_bytes'] / 2**10:8.0f} KiB "
                      f"{r['max_rss_bytes'] / 2**20:5.0f} MiB {r['loss']:10.3f}", flush=True)  # fmt: skip
        finally:
            server.stop()


if __name__ == "__main__":
    main()
