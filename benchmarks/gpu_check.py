"""The CUDA check's assertions (``benchmarks/gpu_check.sh`` runs it on a GPU machine; ``--device cpu``
runs the same checks on Gloo, so the checker itself is tried where there is no GPU).

    python -m benchmarks.gpu_check [--device cuda] [--procs N] [--steps 30] [--only "ddp/allreduce" fsdp ...]

Every strategy runs through the real entrypoint (torchrun, ``workers.runtime.train``) with the SDK
writing into a private Redis; then, per strategy, from what the ranks wrote:
- every rank logged every step once, with the always-on keys; step, data and compute times
  plausible (from events on CUDA); comm figures > 0 with peers, 0 without;
- on CUDA: NVML figures (``gpu_util_pct``, ``gpu_mem_used_bytes`` > 0, ...) and
  ``cuda_max_allocated_bytes`` > 0;
- the sampled steps' timelines: every rank at steps 10, 20, ...; on CUDA kernel lanes per stream
  (``cuda:D stream S``) and comm lanes with peers;
- FSDP with peers: the mean exposed comm below the mean comm time (its side streams overlap compute);
- TP (``tp``, ``fsdp_tp``: DTensor's functional collectives on NCCL, a device mesh on cuda): the
  sequence-parallel all-gathers and reduce-scatters counted at every step, ``param_bytes`` reported.
A strategy the spec refuses at this size (``fsdp_tp``'s 2-D mesh needs 4 ranks) is skipped, saying why.
Prints one line per strategy and exits non-zero if any check failed."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.strategies import STRATEGIES, refusal
from cli.redis_server import RedisServer
from testkit.torchrun import BASE_KEYS, COMM_KEYS, torchrun
from torchyard import streams

WORKLOAD = {
    "kind": "builtin",
    "name": "charlm",
    "params": {"d_model": 256, "n_layers": 4, "n_heads": 4, "seq_len": 128},
}
SMALL = {"kind": "builtin", "name": "charlm", "params": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64}}
NVML_KEYS = {"gpu_util_pct", "gpu_mem_used_bytes", "gpu_power_w", "gpu_temp_c"}


def stream_of(server: RedisServer, run_id: int) -> tuple[dict[tuple[int, int], list[dict[str, float]]], dict]:
    """(rank, step) → the values logged for it (a list: twice would be a fault); (rank, step) → timeline."""
    client = redis.Redis.from_url(server.url)
    entries: Any = client.xrange(streams.rank_stream(run_id))
    client.close()
    points: dict[tuple[int, int], list[dict[str, float]]] = {}
    timelines = {}
    for _id, fields in entries:
        kind, data = streams.decode(fields)
        if kind == streams.METRICS:
            for step, _ts, values in data["points"]:
                points.setdefault((data["rank"], step), []).append(values)
        elif kind == streams.PROFILE:
            timelines[(data["rank"], data["step"])] = data["timeline"]
    return points, timelines


def merged(values: list[dict[str, float]]) -> dict[str, float]:
    return {key: value for one in values for key, value in one.items()}


def check(name: str, points: dict, timelines: dict, procs: int, steps: int, cuda: bool) -> list[str]:
    faults = []
    ranks = range(procs)
    missing = [(r, s) for r in ranks for s in range(1, steps + 1) if (r, s) not in points]
    # a sampled step logs its trace figures as a second point: a key twice is a fault, not a point
    doubled = [key for key, got in points.items() if sum(len(values) for values in got) > len(merged(got))]
    if missing or doubled:
        faults.append(f"{len(missing)} (rank, step) missing, {len(doubled)} with a key logged twice")
    rows = [merged(got) for got in points.values()]
    want = (BASE_KEYS | COMM_KEYS) - {"loss"} | ({"cuda_max_allocated_bytes"} if cuda else set())
    for key in sorted(want):
        if any(key not in row for row in rows):
            faults.append(f"{key} absent from some steps")
    if not any("loss" in row for row in rows):
        faults.append("no rank logged a loss")
    for row in rows:
        step, data = row.get("step_time_s", 0.0), row.get("data_time_s", 0.0)
        if not 0 < step < 30 or not 0 <= data <= step or row.get("compute_time_s", -1) < 0:
            faults.append(f"implausible times: step {step}, data {data}, compute {row.get('compute_time_s')}")
            break
    comm = [row.get("comm_time_s", 0.0) for row in rows]
    if procs > 1 and STRATEGIES[name]["kind"] != "local_sgd" and not all(c > 0 for c in comm):
        faults.append("a step with peers timed no communication")
    if procs == 1 and any(c > 0 for c in comm):
        faults.append("communication timed without peers")
    if cuda:
        nvml = [row for row in rows if NVML_KEYS & set(row)]
        if not nvml or not all(row.get("gpu_mem_used_bytes", 0) > 0 for row in nvml):
            faults.append("no NVML figures (gpu_util_pct, gpu_mem_used_bytes, ...)")
    sampled = sorted({s for _r, s in timelines})
    if sampled != list(range(10, steps + 1, 10)) or len(timelines) != procs * len(sampled):
        faults.append(f"sampled steps {sampled} from {len(timelines)} rank timelines")
    for timeline in timelines.values():
        kinds = {lane["kind"] for lane in timeline["lanes"]}
        if cuda and not any(
            lane["label"].startswith("cuda:") and lane["kind"] == "compute" for lane in timeline["lanes"]
        ):
            faults.append("a sampled step without kernel lanes per stream")
            break
        if procs > 1 and STRATEGIES[name]["kind"] != "local_sgd" and "comm" not in kinds:
            faults.append("a sampled step with peers but no comm lane")
            break
    if STRATEGIES[name]["kind"] in ("tp", "fsdp_tp"):  # DTensor's functional collectives, timed
        sequence_parallel = STRATEGIES[name].get("sequence_parallel", True)
        tp_kinds = ["all_gather", "reduce_scatter"] if sequence_parallel else ["all_reduce"]
        if not all(row.get(f"comm_bytes_{kind}", 0) > 0 for row in rows for kind in tp_kinds):
            faults.append(f"a TP step without {' and '.join(tp_kinds)} bytes")
        if not all(row.get("param_bytes", 0) > 0 for row in rows):
            faults.append("param_bytes absent from some steps")
    if (
        STRATEGIES[name]["kind"] == "fsdp" and procs > 1 and cuda
    ):  # on CPU FSDP's collectives are synchronous: all exposed
        exposed = statistics.fmean(row["exposed_comm_s"] for row in rows)
        total = statistics.fmean(comm)
        if not exposed < total:
            faults.append(f"FSDP exposed {exposed * 1e3:.2f} ms not below comm {total * 1e3:.2f} ms")
    return faults


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--procs", type=int, default=2, help="ranks per run (1: only the DDP variants run)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", nargs="*", choices=list(STRATEGIES), default=list(STRATEGIES))
    args = parser.parse_args()
    server = RedisServer(Path(tempfile.mkdtemp(prefix="gpu-check-redis-"))).start()
    failed = 0
    started = time.monotonic()
    try:
        for name in args.only:
            spec = {
                "name": "gpu-check",
                "workload": WORKLOAD if args.device == "cuda" else SMALL,
                "strategy": STRATEGIES[name],
                "resources": {"procs_per_node": args.procs, "device": args.device},
                "training": {"steps": args.steps, "batch_size": 32, "lr": 0.001, "seed": 0, "profile_every": 10},
            }
            if why := refusal(spec):  # e.g. a strategy across ranks on 1 GPU; fsdp_tp's 2-D mesh on 2
                print(f"skip {name} ({why})", flush=True)
                continue
            run_id, proc = torchrun(server, spec, timeout=300)
            if proc.returncode != 0:
                print(f"FAIL {name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}", flush=True)
                failed += 1
                continue
            points, timelines = stream_of(server, run_id)
            faults = check(name, points, timelines, args.procs, args.steps, args.device == "cuda")
            rows = [merged(got) for got in points.values()]
            shown = (
                f"step {statistics.median(r['step_time_s'] for r in rows) * 1e3:.1f} ms, "
                f"comm {statistics.median(r.get('comm_time_s', 0) for r in rows) * 1e3:.2f} ms, "
                f"exposed {statistics.median(r.get('exposed_comm_s', 0) for r in rows) * 1e3:.2f} ms"
                + (f", GPU util {max(r.get('gpu_util_pct', 0) for r in rows):.0f} %" if args.device == "cuda" else "")
            )
            print(
                f"{'FAIL' if faults else 'ok  '} {name}: {shown}" + "".join(f"\n     - {f}" for f in faults), flush=True
            )
            failed += bool(faults)
    finally:
        server.stop()
    print(f"gpu_check: {time.monotonic() - started:.0f} s, {'passed' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
