"""Dashboard benchmark (prints figures; not a test). Needs the built front end and
/usr/bin/chromium (see README).

1. A run with 1,000,000 steps of ``loss``: the api downsamples (min/max per bucket) to about the
   chart's pixel width; reports the server's time for that request and the browser's time from
   the request's start to the chart drawn (performance mark ``ty:loss-drawn``), split into
   server (request start → first byte) and browser (first byte → drawn).
2. Live: a run streaming 1,000 points/s for ``--live-s`` seconds while its page is open:
   per-frame redraw time (p50/p95/max), frame intervals, and the JS heap after a forced GC
   before and after.

    python -m benchmarks.dashboard [--steps 1000000] [--live-s 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis
from sqlalchemy.orm import Session

from backend.db import make_engine
from backend.ingest import apply_entries
from backend.migrate import upgrade
from backend.models import Run
from backend.security import create_token
from torchyard import streams
from torchyard.procs import RedisServer, free_port, wait_for
from torchyard.settings import Settings, settings_env

CHROMIUM = "/usr/bin/chromium"
SPEC = {
    "name": "bench",
    "workload": {"kind": "builtin", "name": "mlp", "params": {}},
    "strategy": {"kind": "ddp"},
    "resources": {"nodes": 1, "procs_per_node": 1, "device": "cpu", "priority": 0},
    "training": {"steps": 1_000_000, "batch_size": 64, "lr": 0.01, "seed": 0, "log_every": 1},
}


def seed(url: str, steps: int) -> tuple[str, int, int]:
    """An admin token, a finished run with ``steps`` points of loss, and a running run."""
    engine = make_engine(url)
    with Session(engine) as session, session.begin():
        token = create_token(session, "bench", "admin")[1]
        big = Run(name="bench-1m", status="succeeded", spec={**SPEC, "name": "bench-1m"}, last_step=steps)
        live = Run(name="bench-live", status="running", spec={**SPEC, "name": "bench-live"}, last_step=0)
        session.add_all([big, live])
        session.flush()
        big_id, live_id = big.id, live.id
    # Through ingest's own write path (rows and rollups), as a real run's points arrive.
    t0 = time.perf_counter()
    now = time.time()
    stream = streams.run_stream(big_id)
    for start in range(1, steps + 1, 100_000):
        entries = []
        for first in range(start, min(start + 100_000, steps + 1), 5000):
            points = [
                [
                    s,
                    now - (steps - s) * 0.01,
                    {"loss": 2.0 / (1 + s / 1000) + (5.0 if s == 777_777 else 0.01 * ((s * 7919) % 100) / 100)},
                ]
                for s in range(first, min(first + 5000, steps + 1))
            ]
            fields = streams.encode(streams.METRICS, {"attempt": 1, "rank": 0, "points": points, "dropped": 0})
            entries.append((stream, f"{first}-0", fields))
        with Session(engine) as session, session.begin():
            apply_entries(session, entries)
    engine.dispose()
    print(f"seeded {steps:,} points of loss through ingest (rows and rollups) in {time.perf_counter() - t0:.1f} s")
    return token, big_id, live_id


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--live-s", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=1000, help="live points per second")
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="ty-dash-bench-"))
    redis_server = RedisServer(tmp / "redis").start()
    db_url = f"sqlite:///{tmp / 'bench.db'}"
    upgrade(db_url)
    token, big_id, live_id = seed(db_url, args.steps)
    settings = Settings(
        state_dir=tmp / "state", database_url=db_url, redis_url=redis_server.url, port=free_port(), node_id="bench"
    )
    url = f"http://{settings.host}:{settings.port}"
    api = subprocess.Popen([sys.executable, "-m", "torchyard.cli", "api"], env={**os.environ, **settings_env(settings)})
    try:
        wait_for(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 60, "the api")
        headers = {"Authorization": f"Bearer {token}"}
        server_ms = []
        for _ in range(5):
            t0 = time.perf_counter()
            r = httpx.get(
                f"{url}/api/v1/runs/{big_id}/metrics",
                params={"key": "loss", "max_points": 672},
                headers=headers,
                timeout=60,
            )
            server_ms.append((time.perf_counter() - t0) * 1000)
            r.raise_for_status()
        body = r.json()
        spike = max(v for v in body["aggregate"]["max"] if v is not None)
        print(f"\n1M-step run: GET /metrics?key=loss&max_points=672 → {len(body['aggregate']['step'])} points")
        print(f"  server (httpx, 5 tries): median {statistics.median(server_ms):.0f} ms, min {min(server_ms):.0f} ms")
        print(f"  spike at step 777,777 kept: {spike > 4.9}")

        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--enable-precise-memory-info",
                ],
            )
            context = browser.new_context(viewport={"width": 1440, "height": 1000}, base_url=url)
            context.add_init_script("window.__tyPerf = []")
            page = context.new_page()
            page.goto(f"/#/login?token={token}")
            page.wait_for_url("**/#/runs")
            figures = []
            for _ in range(3):
                page.goto("/#/runs")
                page.goto(f"/#/runs/{big_id}")
                page.reload()
                page.wait_for_function("performance.getEntriesByName('ty:loss-drawn').length > 0", timeout=60_000)
                figures.append(
                    page.evaluate(
                        """() => {
                        const r = performance.getEntriesByType('resource')
                          .find(e => e.name.includes('/metrics?') && e.name.includes('key=loss'));
                        const drawn = performance.getEntriesByName('ty:loss-drawn')[0].startTime;
                        return {total: drawn - r.startTime, server: r.responseStart - r.startTime,
                                download: r.responseEnd - r.responseStart, browser: drawn - r.responseEnd};
                      }"""
                    )
                )
            best = min(figures, key=lambda f: f["total"])
            print("  browser, request start → chart drawn (best of 3):")
            print(
                f"    total {best['total']:.0f} ms = server (to first byte) {best['server']:.0f} ms"
                f" + download {best['download']:.0f} ms + browser (parse, shape, draw) {best['browser']:.0f} ms"
            )
            tries = ", ".join(f"{f['total']:.0f}" for f in figures)
            print(f"    all tries: {tries} ms")

            # Live: 1,000 points/s into the run's stream, as the SDK would send them.
            client = redis.Redis.from_url(redis_server.url)
            stop = threading.Event()
            sent = [0]

            def produce() -> None:
                step = 0
                batch = max(1, args.rate // 20)  # the SDK flushes in batches: 20 a second
                next_t = time.perf_counter()
                while not stop.is_set():
                    now = time.time()
                    points = [
                        [step + i + 1, now, {"loss": 1.0 / (1 + (step + i) / 5000), "samples_per_s": 1000.0}]
                        for i in range(batch)
                    ]
                    step += batch
                    client.xadd(
                        streams.run_stream(live_id),
                        streams.encode(streams.METRICS, {"attempt": 1, "rank": 0, "points": points}),
                    )
                    sent[0] += batch
                    next_t += batch / args.rate
                    time.sleep(max(0.0, next_t - time.perf_counter()))

            producer = threading.Thread(target=produce, daemon=True)
            producer.start()
            page.goto(f"/#/runs/{live_id}")
            page.wait_for_function("+document.querySelector('[data-testid=loss-points]')?.dataset.points > 500")
            cdp = context.new_cdp_session(page)

            def heap_mb() -> float:
                cdp.send("HeapProfiler.collectGarbage")
                return float(cdp.send("Runtime.getHeapUsage")["usedSize"]) / 1e6

            time.sleep(3)
            page.evaluate("window.__tyPerf.length = 0")
            heap0 = heap_mb()
            page.evaluate(
                """() => { window.__tyFrames = []; let last = performance.now();
                const f = (t) => { window.__tyFrames.push(t - last); last = t; requestAnimationFrame(f); };
                requestAnimationFrame(f); }"""
            )
            t0 = time.perf_counter()
            sent0 = sent[0]
            page.wait_for_timeout(args.live_s * 1000)
            elapsed = time.perf_counter() - t0
            heap1 = heap_mb()
            redraw: list[float] = page.evaluate("window.__tyPerf.slice()")
            frames: list[float] = page.evaluate("window.__tyFrames.slice(1)")
            shown = page.evaluate("+document.querySelector('[data-testid=loss-points]').dataset.points")
            stop.set()
            producer.join()
            rate = (sent[0] - sent0) / elapsed
            print(f"\nlive: {rate:.0f} points/s for {elapsed:.0f} s into run {live_id} (one rank, loss + samples/s)")
            print(
                f"  redraw per frame (setData of every chart): p50 {pct(redraw, 0.5):.2f} ms,"
                f" p95 {pct(redraw, 0.95):.2f} ms, max {max(redraw or [0]):.2f} ms over {len(redraw)} redraws"
            )
            print(
                f"  frame interval: p50 {pct(frames, 0.5):.1f} ms, p95 {pct(frames, 0.95):.1f} ms,"
                f" dropped (interval > 20 ms): {sum(f > 20 for f in frames)} of {len(frames)}"
            )
            print(f"  JS heap after GC: {heap0:.1f} MB before → {heap1:.1f} MB after ({heap1 - heap0:+.1f} MB)")
            print(f"  loss series held in the page: {shown} rows (bounded by min/max re-decimation)")
            print(json.dumps({"server_ms": statistics.median(server_ms), **best, "heap_mb": [heap0, heap1]}))
            browser.close()
    finally:
        api.terminate()
        api.wait(15)
        redis_server.stop()


if __name__ == "__main__":
    main()
