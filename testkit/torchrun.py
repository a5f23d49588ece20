"""The rank entrypoint without the platform, under the real torch elastic launcher (``torchrun``,
``start_torchrun``) or forked from a warm process (``forked_run``, ``testkit/forked.py``): a spec
in the environment, metrics into a private redis-server, read back point by point."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis

from cli.redis_server import RedisServer
from testkit.forked import Forked, rank_environments
from torchyard import streams
from torchyard.net import free_port

ROOT = Path(__file__).resolve().parents[1]  # the repository: the ranks import workers.runtime from it
Points = list[tuple[int, int, dict[str, float]]]  # (rank, step, values) of every metrics point
_run_ids = iter(range(100, 10_000))


def torchrun(
    server: RedisServer, spec: dict[str, Any], timeout: float = 60, env_extra: dict[str, str] | None = None
) -> tuple[int, subprocess.CompletedProcess[str]]:
    run_id, proc = start_torchrun(server, spec, env_extra)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return run_id, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_torchrun(
    server: RedisServer, spec: dict[str, Any], env_extra: dict[str, str] | None = None
) -> tuple[int, subprocess.Popen[str]]:
    """The same, started: (run id, its torchrun), for a test that does something to it mid-run."""
    run_id = next(_run_ids)
    env = rank_base_env(server, spec, run_id, env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(spec["resources"]["procs_per_node"]), "-m", "workers.runtime.train"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return run_id, proc


def rank_base_env(
    server: RedisServer, spec: dict[str, Any], run_id: int, env_extra: dict[str, str] | None
) -> dict[str, str]:
    """The environment of every rank of a run, but what its launcher adds per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(
        TORCHYARD_SPEC=json.dumps(spec),
        TORCHYARD_RANK_REDIS_URL=server.url,
        TORCHYARD_RUN_ID=str(run_id),
        TORCHYARD_ATTEMPT="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        **(env_extra or {}),
    )
    return env


def forked_run(
    forked: Forked,
    server: RedisServer,
    spec: dict[str, Any],
    logs: Path,
    timeout: float = 60,
    env_extra: dict[str, str] | None = None,
) -> tuple[int, str]:
    """``spec``'s ranks forked from ``forked`` (``testkit/forked.py``) and run to their end: the run
    id and the ranks' output (stdout and stderr, rank by rank). A rank that failed, or a gang past
    ``timeout``, fails the test with that output."""
    run_id = next(_run_ids)
    procs = spec["resources"]["procs_per_node"]
    envs = rank_environments(rank_base_env(server, spec, run_id, env_extra), procs, free_port())
    folder = logs / str(run_id)
    codes, timed_out = forked.run(envs, folder, timeout)
    output = "\n".join(
        f"--- rank {r}: exit {c}\n" + (folder / f"rank-{r}.log").read_text() for r, c in enumerate(codes)
    )
    if timed_out or any(codes):
        raise AssertionError(f"{f'past its {timeout} s: ' if timed_out else ''}ranks ended {codes}\n{output[-12000:]}")
    return run_id, output


def points(server: RedisServer, run_id: int) -> Points:
    """(rank, step, values) of every metrics point, in stream order."""
    client = redis.Redis.from_url(server.url)
    try:
        out = []
        entries: Any = client.xrange(streams.rank_stream(run_id))
        for _id, fields in entries:
            kind, data = streams.decode(fields)
            if kind == streams.FACTS:  # rank 0's word on the attempt, once (torchyard/facts.py)
                continue
            assert kind == streams.METRICS and data["attempt"] == 1 and data["dropped"] == 0
            out += [(data["rank"], step, values) for step, _ts, values in data["points"]]
        return out
    finally:
        client.close()


def spec(workload: dict[str, Any], steps: int, seed: int = 0, batch_size: int = 64) -> dict[str, Any]:
    return {
        "name": "test",
        "workload": workload,
        "strategy": {"kind": "ddp"},
        "resources": {"procs_per_node": 2, "device": "cpu"},
        "training": {"steps": steps, "batch_size": batch_size, "lr": 0.01, "seed": seed, "log_every": 1},
    }


def losses(pts: Points) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss, for the ranks that compute one (not a pipeline's first stage, not a parameter server)."""
    return {(rank, step): values["loss"] for rank, step, values in pts if "loss" in values}


def by_rank(pts: Points, key: str) -> dict[int, dict[int, float]]:
    """{rank: {step: value of ``key``}}, for the points that have it."""
    out: dict[int, dict[int, float]] = {}
    for rank, step, values in pts:
        if key in values:
            out.setdefault(rank, {})[step] = values[key]
    return out


def global_loss(pts: Points, steps: int) -> list[float]:
    """Per step 1..``steps``, the mean of the losses of the ranks that log one: with equal shards, the
    global batch's (a TP group's ranks hold the same; a parameter server logs none)."""
    per_rank = by_rank(pts, "loss")
    return [statistics.fmean(series[s] for series in per_rank.values()) for s in range(1, steps + 1)]


def run_once(
    forked: Forked,
    server: RedisServer,
    runs: Mapping[str, dict[str, Any] | tuple[dict[str, Any], dict[str, str]]],
    logs: Path,
    timeout: float,
) -> Callable[[str], Points]:
    """``get(name)``: the points of ``runs[name]`` (a spec, or a spec and extra environment), its
    ranks forked from ``forked`` the first time a test asks for it, kept for the module's other tests."""
    done: dict[str, Points] = {}

    def get(name: str) -> Points:
        if name not in done:
            entry = runs[name]
            body, env = entry if isinstance(entry, tuple) else (entry, None)
            done[name] = points(server, forked_run(forked, server, body, logs, timeout, env)[0])
        return done[name]

    return get


BASE_KEYS = {"loss", "lr", "step_time_s", "samples_per_s", "data_time_s", "data_wait_s", "data_copy_s"}
COMM_KEYS = {
    "compute_time_s", "comm_time_s", "exposed_comm_s", "comm_fraction", "comm_bytes",
    "algbw_GBps", "busbw_GBps", "busbw_efficiency", "first_comm_at_s", "max_rss_bytes",
    "param_bytes", "optimizer_state_bytes",
}  # fmt: skip
