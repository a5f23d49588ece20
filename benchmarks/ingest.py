"""Ingest benchmark: N simulated ranks log through the real SDK for T seconds; a real
`torchyard ingest` process writes the run stream to the database. Prints, per database:
points/s committed, end-to-end lag (log() to row committed) p50/p99, and points lost.

    python -m benchmarks.ingest [--ranks 4] [--seconds 5] [--keys 4] [--rate 0] [--db both] [--ingest 1 --ingest 2 --ingest 4] [--vs-mlflow]

--rate is log() calls per second per rank; 0 means as fast as they can. --ingest runs that many
ingest processes, sharing the stream's consumer group. Lag is sampled every
50 ms as (now - the log() time of the newest point committed for each rank): how far the
database trails the ranks.

--vs-mlflow also measures MLflow's tracking server on SQLite, in a venv made once under
~/.cache/torchyard-bench (pip install mlflow; skipped, saying why, if that fails): as many
clients as ranks for as many seconds, each calling log_batch with 1000 metrics; points/s counts
the rows in its SQLite file afterwards, then the ratio to torchyard's unthrottled figures."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import psycopg
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.db import make_engine
from backend.migrate import upgrade
from backend.models import Attempt, Metric, Run
from benchmarks.percentiles import pct
from cli.redis_server import RedisServer
from cli.wait import wait_for
from testkit.stack import run_spec
from torchyard import streams
from torchyard.net import free_port
from torchyard.settings import Settings, settings_env

PG_ADMIN_DSN = os.environ.get("TORCHYARD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
MLFLOW_VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchyard-bench" / "mlflow-venv"
MLFLOW_CLIENT = Path(__file__).with_name("mlflow_client.py")


def rank_main(redis_url: str, run_id: int, rank: int, seconds: float, keys: int, rate: float, out: mp.Queue) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not main()'s: a rank told to end just ends
    os.environ.update(
        TORCHYARD_RANK_REDIS_URL=redis_url, TORCHYARD_RUN_ID=str(run_id), RANK=str(rank), TORCHYARD_SDK_BUFFER="5000000"
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


def _end(proc: subprocess.Popen[bytes] | mp.Process) -> None:
    """Stops a process this benchmark started (a no-op once it has exited)."""
    proc.terminate()
    if isinstance(proc, subprocess.Popen):
        proc.wait(30)
    else:
        proc.join(30)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """Stops a process started in a session of its own and every process it started there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL: whatever outlived its parent, or hung
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)


def bench(db_url: str, label: str, args: argparse.Namespace) -> float:
    """Prints one database's figures; returns its points/s committed."""
    # Everything started here ends here, also on an error or Ctrl-C: the private redis-server runs
    # in a session of its own, so nothing else would stop it (earlier runs left it behind).
    with contextlib.ExitStack() as ends:
        tmp = Path(ends.enter_context(tempfile.TemporaryDirectory(prefix="ty-bench-")))
        server = ends.enter_context(RedisServer(tmp / "redis").start())
        upgrade(db_url)
        engine = make_engine(db_url)
        ends.callback(engine.dispose)
        with Session(engine) as session, session.begin():
            # ingest takes a rank's points only for the run's current attempt and ranks below its world size
            run = Run(name="ingest-bench", status="running", spec=run_spec(procs=args.ranks), priority=0)
            session.add(run)
            session.flush()
            session.add(Attempt(run_id=run.id, number=1, status="running"))
            run_id = run.id
        client = redis.Redis.from_url(server.url)
        stream = streams.rank_stream(run_id)  # where the SDK writes
        client.xgroup_create(stream, streams.INGEST_GROUP, id="0", mkstream=True)
        client.sadd(streams.ACTIVE_STREAMS, stream)
        settings = Settings(state_dir=tmp, database_url=db_url, redis_url=server.url)
        for _ in range(args.ingest_procs):  # they share the stream's consumer group
            ingest = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "ingest"],
                env={**os.environ, **settings_env(settings)},
                stderr=subprocess.DEVNULL,
            )
            ends.callback(_end, ingest)

        out: mp.Queue = mp.Queue()
        ranks = [
            mp.Process(target=rank_main, args=(server.url, run_id, r, args.seconds, args.keys, args.rate, out))
            for r in range(args.ranks)
        ]
        started = time.time()
        for p in ranks:
            p.start()
            ends.callback(_end, p)
        lags: list[float] = []
        results: list[tuple[int, int, int]] = []
        # Cheap probes, so the sampler does not compete with ingest for the 2 cores (a count(*) of
        # every row each 50 ms took a core of its own and held back SQLite's checkpoints): each
        # rank's newest point of one key through the unique index, and ingest's count of points
        # written (Redis); the exact count once at the end.
        newest = [
            select(Metric.ts)
            .where(Metric.run_id == run_id, Metric.key == "k0", Metric.rank == r)
            .order_by(Metric.step.desc())
            .limit(1)
            for r in range(args.ranks)
        ]
        deadline = time.time() + args.seconds + 300
        with Session(engine) as session:
            while time.time() < deadline:  # sample until every rank is done and everything is stored
                times = [session.scalar(query) for query in newest]
                session.rollback()  # a fresh snapshot next time
                now = time.time()
                if all(ts is not None for ts in times):
                    lags.extend(now - ts for ts in times if ts is not None)
                while not out.empty():
                    results.append(out.get())
                stored_now = int(client.get(streams.INGESTED_POINTS) or 0)
                if len(results) == args.ranks and stored_now >= sum(s - d for _, s, d in results) * args.keys:
                    break
                time.sleep(0.05)
        logged = sum(steps for _, steps, _ in results) * args.keys
        dropped = sum(d for _, _, d in results) * args.keys
        drained = time.time()  # ingest counts points after they are committed
        with Session(engine) as session:
            count = session.scalar(select(func.count()).select_from(Metric).where(Metric.run_id == run_id)) or 0
    rate = "max" if not args.rate else f"{args.rate:.0f}/s"
    print(
        f"{label:<11} ingest×{args.ingest_procs} ranks={args.ranks} rate={rate:<7} logged={logged:>10,} stored={count:>10,} "
        f"points/s={count / (drained - started):>10,.0f}  lag p50={pct(lags, 0.5) * 1000:>7.1f} ms p99={pct(lags, 0.99) * 1000:>8.1f} ms  "
        f"dropped={dropped} lost={logged - dropped - count}"
    )
    return count / (drained - started)


def mlflow_python() -> Path | None:
    """The python of a venv with MLflow, made once and then reused; None, saying why, if pip fails."""
    python = MLFLOW_VENV / "bin" / "python"
    if (MLFLOW_VENV / "bin" / "mlflow").exists():
        return python
    print(f"making {MLFLOW_VENV}: pip install mlflow (minutes, once)", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(MLFLOW_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "mlflow"], check=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"mlflow     skipped: it could not be installed in {MLFLOW_VENV} ({exc})")
        return None
    return python


def _mlflow_rows(db: Path) -> int:
    """The metric points in MLflow's SQLite file: what it stored, not what was sent."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute("SELECT count(*) FROM metrics").fetchone()[0])


def bench_mlflow(args: argparse.Namespace) -> float | None:
    """MLflow's tracking server on SQLite under the same load: prints its figures, returns its
    points/s stored (None if MLflow could not be installed)."""
    python = mlflow_python()
    if python is None:
        return None
    with contextlib.ExitStack() as ends:
        tmp = Path(ends.enter_context(tempfile.TemporaryDirectory(prefix="ty-bench-mlflow-")))
        db, url, log_path = tmp / "mlflow.db", f"http://127.0.0.1:{free_port()}", tmp / "mlflow.log"
        log = ends.enter_context(log_path.open("wb"))
        # Its own session: `mlflow server` starts uvicorn, which starts workers; all end with the
        # group. Job execution off: its six huey consumers run GenAI jobs, not metrics, and would
        # take CPU from the server on 2 cores (and leave their store in /dev/shm behind).
        server = subprocess.Popen(
            [str(python.parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{db}",
             "--default-artifact-root", str(tmp / "artifacts"), "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1]],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )  # fmt: skip
        ends.callback(_end_group, server)

        def failed(what: str) -> str:
            return f"{what}; its log ends:\n" + log_path.read_text(errors="replace")[-3000:]

        def answers() -> bool:
            assert server.poll() is None, failed("mlflow server exited")
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                return bool(response.status == 200)

        wait_for(answers, 300, f"mlflow server at {url}")
        clients = []
        for _ in range(args.ranks):
            client = subprocess.Popen(
                [str(python), str(MLFLOW_CLIENT), url, str(args.keys), str(args.seconds)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            )  # fmt: skip
            ends.callback(_end, client)
            clients.append(client)
        for client in clients:  # each has imported MLflow, made its run and warmed its worker
            ready = client.stdout.readline().split()  # type: ignore[union-attr]
            if not ready:
                raise RuntimeError(failed("an mlflow client exited before it was ready"))
        warmup = _mlflow_rows(db)
        started = time.time()
        for client in clients:
            client.stdin.write(b"go\n")  # type: ignore[union-attr]
            client.stdin.flush()  # type: ignore[union-attr]
        outs = [client.communicate(timeout=args.seconds + 300)[0] for client in clients]
        ended = time.time()
        if not all(outs):
            raise RuntimeError(failed("an mlflow client failed"))
        sent = sum(map(int, outs))
        count = _mlflow_rows(db) - warmup
    print(
        f"{'mlflow':<11} ranks={args.ranks} rate=max     logged={sent:>10,} stored={count:>10,} "
        f"points/s={count / (ended - started):>10,.0f}  (MLflow {ready[1].decode()}, SQLite, log_batch of "
        f"{1000 // args.keys * args.keys} per call)  lost={sent - count}"
    )
    return count / (ended - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--keys", type=int, default=4, help="scalars per log() call")
    parser.add_argument("--rate", type=float, action="append", help="log() calls/s per rank; 0 = max (repeatable)")
    parser.add_argument("--db", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument(
        "--ingest", type=int, action="append", help="ingest processes sharing the consumer group (repeatable; 1)"
    )
    parser.add_argument("--vs-mlflow", action="store_true", help="MLflow's server on SQLite too, and the ratio")
    args = parser.parse_args()
    # a plain `kill` ends the benchmark as Ctrl-C does: through the clean-ups that stop what it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rates = args.rate or [1000.0, 0.0]
    unthrottled: dict[str, float] = {}  # database -> torchyard's points/s at --rate 0
    for rate, procs in itertools.product(rates, args.ingest or [1]):
        args.rate, args.ingest_procs = rate, procs
        if args.db in ("sqlite", "both"):
            with tempfile.TemporaryDirectory(prefix="ty-bench-db-") as tmp:
                points_s = bench(f"sqlite:///{tmp}/bench.db", "sqlite", args)
            if not rate:
                unthrottled["sqlite"] = max(points_s, unthrottled.get("sqlite", 0.0))
        if args.db in ("postgresql", "both"):
            name = f"torchyard_bench_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            try:
                base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
                points_s = bench(f"{base}/{name}", "postgresql", args)
                if not rate:
                    unthrottled["postgresql"] = max(points_s, unthrottled.get("postgresql", 0.0))
            finally:
                with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if args.vs_mlflow and (mlflow := bench_mlflow(args)):
        for db, points_s in unthrottled.items():
            print(f"torchyard on {db} / MLflow on SQLite: {points_s / mlflow:.1f}×")
        if not unthrottled:
            print("no ratio: torchyard ran paced only (add --rate 0)")


if __name__ == "__main__":
    main()
