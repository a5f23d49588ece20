"""Dashboard benchmark (prints figures; not a test). Needs the built front end and
/usr/bin/chromium (see README).

1. A run with 1,000,000 steps of ``loss``: the api downsamples (min/max per bucket) to about the
   chart's pixel width; reports the server's time for that request and the browser's time from
   the request's start to the chart's pixels on screen (performance mark ``ty:loss-drawn``, set on
   the animation frame after uPlot's draw), split into server (request start → first byte),
   download and browser (parse, shape, draw); median and p90 over ``--loads`` cold loads.
2. Live: a rank logging 1,000 and 10,000 points/s (``--rate``) through the real SDK for
   ``--live-s`` seconds each while its run's page is open: the painted latency (``log()`` → the
   frame after its chart drew the point; p50/p90/p99/max), per-frame redraw time (p50/p95/max), frame intervals, and the JS
   heap after a forced GC before and after.

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
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.orm import Session

from backend.db import make_engine
from backend.ingest import apply_entries
from backend.migrate import upgrade
from backend.models import Run
from backend.security import create_token
from benchmarks.percentiles import pct
from cli.redis_server import RedisServer
from cli.wait import wait_for
from torchyard import streams
from torchyard.net import free_port
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


# request start of the loss series → the loss chart's pixels (the frame after uPlot drew it), in parts
DRAWN_JS = """() => {
  const r = performance.getEntriesByType('resource')
    .find(e => e.name.includes('/metrics?') && e.name.includes('key=loss'));
  const drawn = performance.getEntriesByName('ty:loss-drawn')[0].startTime;
  return {total: drawn - r.startTime, server: r.responseStart - r.startTime,
          download: r.responseEnd - r.responseStart, browser: drawn - r.responseEnd};
}"""


PRODUCER = """
import sys, threading, time, torchyard
step, rate = int(sys.argv[1]), int(sys.argv[2])
stop = threading.Event()
def commands():
    for line in sys.stdin:
        if line.strip() == "stop":
            return stop.set()
        print(step, flush=True)
threading.Thread(target=commands, daemon=True).start()
first, start = step, time.perf_counter()
while not stop.is_set():
    step += 1
    torchyard.log(step, loss=1.0 / (1 + step / 5000), samples_per_s=1000.0)
    ahead = (step - first) * 2 / rate - (time.perf_counter() - start)
    if ahead > 0:
        time.sleep(ahead)
torchyard.flush(30)
print(step, flush=True)
"""


def producer_step(producer: subprocess.Popen[str]) -> int:
    assert producer.stdin is not None and producer.stdout is not None
    producer.stdin.write("at\n")
    producer.stdin.flush()
    return int(producer.stdout.readline())


def live(
    browser: Any, url: str, token: str, redis_url: str, run_id: int, rate: int, seconds: float, step: list[int]
) -> dict[str, float]:
    """``rate`` points/s from a rank's ``torchyard.log()`` into the running run's stream while its page is
    open: per-frame redraw time, frame intervals, the JS heap, and the painted latency (a point's
    time stamp, set by log() → the animation frame after the charts drew it). Prints them; returns the main ones."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000}, base_url=url, bypass_csp=True)
    context.add_init_script("window.__tyPerf = []; window.__tyPaint = []")
    page = context.new_page()
    page.goto(f"/#/login?token={token}")
    page.wait_for_url("**/#/runs")
    # A rank of the run, logging through the real SDK (points stamped by log(), sent as the SDK sends
    # them), paced at `rate` points/s (2 a log() call); it prints its last step when told to stop.
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(step[0]), str(rate)],
        env={
            **os.environ,
            "TORCHYARD_RANK_REDIS_URL": redis_url,
            "TORCHYARD_RUN_ID": str(run_id),
            "TORCHYARD_ATTEMPT": "1",
            "RANK": "0",
        },
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        page.goto(f"/#/runs/{run_id}")
        page.wait_for_function("+document.querySelector('[data-testid=loss-points]')?.dataset.points > 500")
        cdp = context.new_cdp_session(page)

        def heap_mb() -> float:
            cdp.send("HeapProfiler.collectGarbage")
            return float(cdp.send("Runtime.getHeapUsage")["usedSize"]) / 1e6

        time.sleep(3)
        page.evaluate("window.__tyPerf.length = 0; window.__tyPaint.length = 0")
        heap0 = heap_mb()
        page.evaluate(
            """() => { window.__tyFrames = []; let last = performance.now();
            const f = (t) => { window.__tyFrames.push(t - last); last = t; requestAnimationFrame(f); };
            requestAnimationFrame(f); }"""
        )
        t0 = time.perf_counter()
        step0 = producer_step(producer)
        page.wait_for_timeout(seconds * 1000)
        elapsed = time.perf_counter() - t0
        step1 = producer_step(producer)
        heap1 = heap_mb()
        redraw: list[float] = page.evaluate("window.__tyPerf.slice()")
        painted = [s * 1000 for s in page.evaluate("window.__tyPaint.slice()")]
        frames: list[float] = page.evaluate("window.__tyFrames.slice(1)")
        shown = page.evaluate("+document.querySelector('[data-testid=loss-points]').dataset.points")
    finally:
        out, _ = producer.communicate("stop\n", timeout=60)
        step[0] = int(out.split()[-1])
        context.close()
    achieved = (step1 - step0) * 2 / elapsed  # 2 points a step
    print(f"\nlive: {achieved:.0f} points/s for {elapsed:.0f} s into run {run_id} (one rank, loss + samples/s)")
    print(
        f"  painted latency (log() → the frame after its chart drew the point): p50 {pct(painted, 0.5):.0f} ms,"
        f" p90 {pct(painted, 0.9):.0f} ms, p99 {pct(painted, 0.99):.0f} ms, max {max(painted or [0]):.0f} ms"
        f" over {len(painted)} redraws"
    )
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
    return {"painted_p50_ms": pct(painted, 0.5), "painted_p99_ms": pct(painted, 0.99), "heap_mb": heap1 - heap0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--live-s", type=float, default=20.0)
    parser.add_argument("--rate", type=int, action="append", help="live points per second (repeatable; 1000 and 10000)")
    parser.add_argument("--loads", type=int, default=7, help="cold loads of the 1M-step run page (≥ 5)")
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
    api = subprocess.Popen([sys.executable, "-m", "cli.main", "api"], env={**os.environ, **settings_env(settings)})
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
            figures = []
            for _ in range(args.loads):  # each a cold load: a new browser context, nothing cached
                cold = browser.new_context(viewport={"width": 1440, "height": 1000}, base_url=url, bypass_csp=True)
                page = cold.new_page()
                page.goto(f"/#/login?token={token}")
                page.wait_for_url("**/#/runs")
                page.goto(f"/#/runs/{big_id}")
                page.wait_for_function("performance.getEntriesByName('ty:loss-drawn').length > 0", timeout=60_000)
                figures.append(page.evaluate(DRAWN_JS))
                cold.close()
            print(f"  browser, request start → loss chart's pixels on screen ({args.loads} cold loads, median / p90):")
            for part in ("total", "server", "download", "browser"):
                got = [f[part] for f in figures]
                print(f"    {part:9s} {statistics.median(got):6.0f} / {pct(got, 0.9):6.0f} ms")
            tries = ", ".join(f"{f['total']:.0f}" for f in figures)
            print(f"    every load's total: {tries} ms")
            drawn = {
                part: statistics.median(f[part] for f in figures) for part in ("total", "server", "download", "browser")
            }
            live_figures: dict[int, dict[str, float]] = {}

            step = [0]
            for rate in args.rate or [1000, 10000]:
                live_figures[rate] = live(browser, url, token, redis_server.url, live_id, rate, args.live_s, step)
            print(json.dumps({"server_ms": statistics.median(server_ms), **drawn, "live": live_figures}))
            browser.close()
    finally:
        api.terminate()
        api.wait(15)
        redis_server.stop()


if __name__ == "__main__":
    main()
