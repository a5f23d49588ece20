"""Ingest benchmark: N simulated ranks log through the real SDK for T seconds; a real
`torchyard ingest` process writes the run stream to the database. Prints, per database:
points/s committed, end-to-end lag (log() to row committed) p50/p99, and points lost.

    python -m benchmarks.ingest [--ranks 4] [--seconds 5] [--keys 4] [--rate 0] [--db both]

--rate is log() calls per second per rank; 0 means as fast as they can. Lag is sampled every
50 ms as (now - the log() time of the newest point committed for each rank): how far the
database trails the ranks."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.db import make_engine
from backend.migrate import upgrade
from backend.models import Metric, Run
from torchyard import streams
from torchyard.procs import RedisServer
from torchyard.settings import Settings, settings_env

PG_ADMIN_DSN = os.environ.get("TORCHYARD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def rank_main(redis_url: str, run_id: int, rank: int, seconds: float, keys: int, rate: float, out: mp.Queue) -> None:
    os.environ.update(
        TORCHYARD_REDIS_URL=redis_url, TORCHYARD_RUN_ID=str(run_id), RANK=str(rank), TORCHYARD_SDK_BUFFER="5000000"
    )
    import torchyard
    from torchyard import sdk

    names = [f"k{i}" for i in range(keys)]
    step, start = 0, time.perf_counter()
    end = start + seconds
    while (now := time.perf_counter()) < end:
        if rate and step >= (now - start) * rate:
            time.sleep(min(0.001, end - now))
            continue
        step += 1
        torchyard.log(step, **{name: step * 0.5 for name in names})
    torchyard.flush(120)
    out.put((rank, step, sdk._get().dropped))  # type: ignore[union-attr]


def bench(db_url: str, label: str, args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ty-bench-"))
    server = RedisServer(tmp / "redis").start()
    upgrade(db_url)
    engine = make_engine(db_url)
    with Session(engine) as session, session.begin():
        run = Run(name="ingest-bench", status="running", spec={}, priority=0)
        session.add(run)
        session.flush()
        run_id = run.id
    client = redis.Redis.from_url(server.url)
    stream = streams.run_stream(run_id)
    client.xgroup_create(stream, streams.INGEST_GROUP, id="0", mkstream=True)
    client.sadd(streams.ACTIVE_STREAMS, stream)
    settings = Settings(state_dir=tmp, database_url=db_url, redis_url=server.url)
    ingest = subprocess.Popen(
        [sys.executable, "-m", "torchyard.cli", "ingest"],
        env={**os.environ, **settings_env(settings)},
        stderr=subprocess.DEVNULL,
    )

    out: mp.Queue = mp.Queue()
    ranks = [
        mp.Process(target=rank_main, args=(server.url, run_id, r, args.seconds, args.keys, args.rate, out))
        for r in range(args.ranks)
    ]
    started = time.time()
    for p in ranks:
        p.start()
    lags: list[float] = []
    results: list[tuple[int, int, int]] = []
    newest = select(Metric.rank, func.max(Metric.ts), func.count()).where(Metric.run_id == run_id).group_by(Metric.rank)
    deadline = time.time() + args.seconds + 300
    with Session(engine) as session:
        while time.time() < deadline:  # sample until every rank is done and everything is stored
            rows = session.execute(newest).all()
            session.rollback()  # a fresh snapshot next time
            now = time.time()
            if len(rows) == args.ranks:
                lags.extend(now - ts for _, ts, _ in rows)
            while not out.empty():
                results.append(out.get())
            stored_now = sum(n for _, _, n in rows)
            if len(results) == args.ranks and stored_now >= sum(s - d for _, s, d in results) * args.keys:
                break
            time.sleep(0.05)
    logged = sum(steps for _, steps, _ in results) * args.keys
    dropped = sum(d for _, _, d in results) * args.keys
    with Session(engine) as session:
        count = session.scalar(select(func.count()).select_from(Metric).where(Metric.run_id == run_id)) or 0
    drained = time.time()
    ingest.terminate()
    ingest.wait()
    server.stop()
    engine.dispose()
    lags.sort()

    def pct(q: float) -> float:
        return lags[min(len(lags) - 1, int(q * len(lags)))] * 1000 if lags else float("nan")

    rate = "max" if not args.rate else f"{args.rate:.0f}/s"
    print(
        f"{label:<11} ranks={args.ranks} rate={rate:<7} logged={logged:>10,} stored={count:>10,} "
        f"points/s={count / (drained - started):>10,.0f}  lag p50={pct(0.5):>7.1f} ms p99={pct(0.99):>8.1f} ms  "
        f"dropped={dropped} lost={logged - dropped - count}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--keys", type=int, default=4, help="scalars per log() call")
    parser.add_argument("--rate", type=float, action="append", help="log() calls/s per rank; 0 = max (repeatable)")
    parser.add_argument("--db", choices=["sqlite", "postgresql", "both"], default="both")
    args = parser.parse_args()
    rates = args.rate or [1000.0, 0.0]
    for rate in rates:
        args.rate = rate
        if args.db in ("sqlite", "both"):
            bench(f"sqlite:///{tempfile.mkdtemp(prefix='ty-bench-db-')}/bench.db", "sqlite", args)
        if args.db in ("postgresql", "both"):
            name = f"torchyard_bench_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            try:
                base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
                bench(f"{base}/{name}", "postgresql", args)
            finally:
                with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
