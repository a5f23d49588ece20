"""Straggler endpoints at scale (prints figures; not a test): a synthetic run of 64 ranks × 100,000
steps with every part of the step (``step_time_s``, ``data_time_s``, ``compute_time_s``,
``exposed_comm_s``, ``first_comm_at_s``: 32 million rows and their rollups, written through ingest's
own bulk insert), rank 17 loading its data 30 ms a step slower from the middle step on. A real api
process answers; each request is timed with httpx (median and max of ``--tries``):

- ``GET /stragglers`` (the newest 100 steps): must name rank 17, cause data;
- ``GET /heatmap`` over the whole run (read from the rollups), and zoomed to 10,000 steps (rollups)
  and to 2,000 steps (the rows): rank 17's row must be the hottest in the second half.

    python -m benchmarks.stragglers [--ranks 64] [--steps 100000] [--db PATH (kept: seeded once)]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from backend import bulk, rollups
from backend.db import make_engine
from backend.migrate import upgrade
from backend.models import Metric, Run
from backend.security import create_token
from backend.stragglers import PARTS
from cli.redis_server import RedisServer
from cli.wait import wait_for
from testkit.stack import run_spec
from torchyard.net import free_port
from torchyard.settings import Settings, settings_env

SLOW_RANK, SLOW_S = 17, 0.030  # (the last rank of fewer than 18)
CHUNK = 1000  # steps written per transaction (64,000 rows a key)


def parts(ranks: int, steps: np.ndarray, slow_from: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """[rank, step] arrays of every part: ~70 ms steps, a few ms of jitter, one rank slow to load its
    data from ``slow_from`` on, the others waiting that long in their all-reduce."""
    shape = (ranks, len(steps))
    data = 0.005 + rng.exponential(0.001, shape)
    compute = 0.060 + rng.normal(0, 0.002, shape).clip(-0.006, 0.006)
    slow = np.zeros(shape, dtype=bool)
    slow[min(SLOW_RANK, ranks - 1)] = steps >= slow_from
    data += np.where(slow, SLOW_S, 0.0)
    arrival = data + 0.7 * compute
    step_end = (data + compute).max(axis=0) + 0.004  # the step ends when the last rank's all-reduce does
    exposed = step_end - data - compute
    return {"step_time_s": np.broadcast_to(step_end, shape), "data_time_s": data, "compute_time_s": compute,
            "exposed_comm_s": exposed, "first_comm_at_s": arrival}  # fmt: skip


def seed(url: str, ranks: int, steps: int) -> tuple[str, int]:
    """An admin token and the run, its points written as ingest writes them (rows and rollups)."""
    engine = make_engine(url)
    with Session(engine) as session, session.begin():
        token = create_token(session, "bench", "admin")[1]
        found = session.scalar(select(Run).where(Run.name == "stragglers-bench"))
        if found is not None:
            engine.dispose()
            return token, found.id
        spec = run_spec(name="stragglers-bench", procs=ranks, steps=steps, batch_size=10 * ranks)
        run = Run(name="stragglers-bench", status="succeeded", spec=spec, priority=0, last_step=steps)
        session.add(run)
        session.flush()
        run_id = run.id
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    table = cast(Table, Metric.__table__)
    for first in range(1, steps + 1, CHUNK):
        chunk = np.arange(first, min(first + CHUNK, steps + 1))
        with Session(engine) as session, session.begin():
            for key, values in parts(ranks, chunk, steps // 2 + 1, rng).items():
                rows = [
                    {"run_id": run_id, "attempt": 1, "rank": rank, "step": int(step), "key": key,
                     "value": float(values[rank, i]), "ts": 1.7e9 + float(step) * 0.1, "entry_pos": None}
                    for i, step in enumerate(chunk) for rank in range(ranks)
                ]  # fmt: skip
                inserted = bulk.insert(session, table, rows, returning=rollups.COLUMNS)
                rollups.merge(session, rollups.accumulate(inserted))  # type: ignore[arg-type]
        if first % 10_000 == 1:
            print(f"  seeded to step {first + CHUNK - 1:,} ({time.perf_counter() - t0:.0f} s)", flush=True)
    engine.dispose()
    print(f"seeded {ranks} ranks × {steps:,} steps × {len(PARTS)} keys in {time.perf_counter() - t0:.0f} s")
    return token, run_id


def timed(client: httpx.Client, path: str, tries: int, **params: Any) -> tuple[dict[str, Any], list[float]]:
    took = []
    for _ in range(tries):
        t0 = time.perf_counter()
        response = client.get(path, params=params)
        took.append((time.perf_counter() - t0) * 1000)
        response.raise_for_status()
    return response.json(), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--db", type=Path, default=None, help="SQLite file to seed (once) and keep")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ty-strag-bench-"))
    db = args.db or tmp / "bench.db"
    url = f"sqlite:///{db}"
    upgrade(url)
    token, run_id = seed(url, args.ranks, args.steps)
    redis_server = RedisServer(tmp / "redis").start()
    settings = Settings(state_dir=tmp / "state", database_url=url, redis_url=redis_server.url, port=free_port(),
                        node_id="bench")  # fmt: skip
    base = f"http://{settings.host}:{settings.port}"
    api = subprocess.Popen([sys.executable, "-m", "cli.main", "api"], env={**os.environ, **settings_env(settings)})
    try:
        wait_for(lambda: httpx.get(f"{base}/readyz", timeout=2).status_code == 200, 60, "the api")
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120)
        print(f"\nrun of {args.ranks} ranks × {args.steps:,} steps; each request {args.tries} times (median, max):")
        found, took = timed(client, f"/api/v1/runs/{run_id}/stragglers", args.tries)
        print(f"  GET /stragglers (newest 100 steps): {statistics.median(took):.0f} ms, max {max(took):.0f} ms")
        print(f"    {found['headline']}")
        slow_rank = min(SLOW_RANK, args.ranks - 1)
        named = [(s["rank"], s["cause"]) for s in found["stragglers"]]
        assert named == [(slow_rank, "data")], named
        half = args.steps // 2
        views: list[tuple[str, dict[str, str | int]]] = [
            ("whole run", {"key": "step_time_s", "max_points": 400}),
            ("whole run, data", {"key": "data_time_s", "max_points": 400}),
            (
                "10,000 steps",
                {
                    "key": "data_time_s",
                    "max_points": 600,
                    "step_min": max(1, half - 5000),
                    "step_max": min(args.steps, half + 4999),
                },
            ),
            (
                "2,000 steps",
                {
                    "key": "data_time_s",
                    "max_points": 600,
                    "step_min": max(1, half - 1000),
                    "step_max": min(args.steps, half + 999),
                },
            ),
        ]
        for label, params in views:
            heat, took = timed(client, f"/api/v1/runs/{run_id}/heatmap", args.tries, **params)
            values = np.array(heat["values"], dtype=np.float64)
            size = len(client.get(f"/api/v1/runs/{run_id}/heatmap", params=params).content)
            print(f"  GET /heatmap {label}: {statistics.median(took):.0f} ms, max {max(took):.0f} ms; "
                  f"{len(heat['ranks'])} × {len(heat['steps'])} cells of {heat['bucket_steps']:,} steps, "
                  f"{size / 1e3:.0f} kB")  # fmt: skip
            if params["key"] == "data_time_s":
                late = values[:, values.shape[1] * 3 // 4 :]
                assert int(np.nanargmax(np.nanmean(late, axis=1))) == heat["ranks"].index(slow_rank)
        print(f"  rank {slow_rank}'s row is the hottest after step {half + 1:,} in every data heatmap")
    finally:
        api.terminate()
        api.wait(15)
        redis_server.stop()
        if args.db is None:
            db.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
