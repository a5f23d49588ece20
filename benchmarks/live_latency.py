"""Live latency (prints figures; not a test): from a rank's ``torchyard.log()`` to the point
arriving at SSE clients of ``/api/v1/runs/{id}/stream``, on a whole stack (api, ingest, worker,
Redis: real processes, SQLite).

    python -m benchmarks.live_latency [--rate 1000 --rate 10000] [--viewers 1 --viewers 100] [--seconds 8]

A script run of 2 ranks logs ``--keys`` scalars per step, paced so that the ranks together log
``--rate`` points a second. For each viewer count, that many clients hold the run's live stream
open in one asyncio process; up to ``MEASURED`` of them time every point they receive against the
time ``log()`` stamped on it (the same clock: one machine), the rest read and discard, as idle
browsers would; the measured seconds start a second after every viewer is connected (how long that took is
printed). Prints points/s received per measured viewer (bytes/s drained by the others) and
latency p50/p90/p99/max, with the run's viewers sharing one reader (the default), and for the most
viewers also with a reader per viewer (the baseline). Goals (issue 13): p50 ≤ 30 ms and p99 ≤ 100 ms
at 10,000 points/s.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
import tempfile
import time
import urllib.parse
from pathlib import Path

import orjson

from benchmarks.percentiles import pct
from testkit.stack import RunningStack, sqlite_stack

SETTLE_S = 1.0
MEASURED = 4  # viewers that parse and time every event (parsing at 100 viewers would measure this process)
SCRIPT = """
import os, time, torchyard
rate, keys, seconds = {rate}, {keys}, {seconds}
steps_per_s = rate / keys / int(os.environ["WORLD_SIZE"])  # the ranks together log `rate` points/s
start = time.time()
step = 0
while time.time() - start < seconds:
    step += 1
    torchyard.log(step, **{{f"k{{i}}": float(step) for i in range(keys)}})
    ahead = step / steps_per_s - (time.time() - start)
    if ahead > 0:
        time.sleep(ahead)
torchyard.flush(30)
"""


class Window:
    """The measured seconds: they start once every viewer is connected, so 100 viewers connecting
    at once (each request's authentication, its first read) is timed apart, not in the latencies."""

    def __init__(self, viewers: int, seconds: float) -> None:
        self.waiting, self.seconds = viewers, seconds
        self.opened = time.time()
        self.start = self.until = math.inf

    def connected(self) -> None:
        self.waiting -= 1
        if not self.waiting:  # and a second to settle: the last connections' first reads
            self.start = time.time() + SETTLE_S
            self.until = self.start + self.seconds


async def view(stack: RunningStack, run_id: int, measure: bool, window: Window, out: list[float]) -> int:
    """Holds the run's stream open through the window, on a bare socket (HTTP/1.0: no chunked framing
    to undo): httpx's per-chunk cost, 100 times over, took this process's whole core and measured
    it, not the api. A measured viewer times each point it receives in the window into ``out`` and
    returns the points; the others only drain the bytes (returned), as idle browsers would."""
    address = urllib.parse.urlsplit(stack.url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    writer.write(
        f"GET /api/v1/runs/{run_id}/stream?since=%24 HTTP/1.0\r\nHost: {address.netloc}\r\n"
        f"Authorization: Bearer {stack.token}\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"200", head
    window.connected()
    received, rest = 0, b""
    try:
        while (left := window.until - time.time()) > 0:
            try:
                chunk = await asyncio.wait_for(reader.read(1 << 16), min(left, 1.0))
            except TimeoutError:
                continue
            if not chunk:
                break
            now = time.time()
            if not measure:
                received += len(chunk) if now >= window.start else 0
                continue
            *events, rest = (rest + chunk).split(b"\n\n")
            if now < window.start:
                continue
            for event in events:
                if b"event: metrics\n" in event:
                    points = orjson.loads(event[event.index(b"data: ") + 6 :])["points"]
                    out.extend(now - ts for _, ts, values in points for _ in values)
                    received += sum(len(values) for _, _, values in points)
    finally:
        writer.close()
    return received


async def watch(stack: RunningStack, run_id: int, viewers: int, seconds: float) -> tuple[list[float], list[int], float]:
    """Each measured viewer's latencies, what each viewer received in the window (points, or bytes for
    the idle ones), and the seconds the viewers took to connect."""
    latencies: list[float] = []
    window = Window(viewers, seconds)
    counts = await asyncio.gather(*(view(stack, run_id, i < MEASURED, window, latencies) for i in range(viewers)))
    return latencies, list(counts), window.start - window.opened


def one(stack: RunningStack, rate: int, viewers: int, keys: int, seconds: float) -> str:
    script = SCRIPT.format(rate=rate, keys=keys, seconds=seconds + 10)
    run = stack.client.submit_script(f"live-{rate}-{viewers}", "paced.py", script, procs=2)
    stack.client.wait_status(run["id"], {"running"}, timeout=120)
    time.sleep(2)  # the ranks' start-up (import, rendezvous): measured points are steady-state ones
    left_before = left_behind(stack)
    latencies, counts, connecting = asyncio.run(watch(stack, run["id"], viewers, seconds))
    left = left_behind(stack) - left_before
    # settles the run before the next one: its 2 slots come back
    stack.client.wait_status(run["id"], {"succeeded"}, timeout=seconds + 120)
    ms = [s * 1000 for s in latencies]
    measured, idle = counts[:MEASURED], counts[MEASURED:]
    drained = f"  idle viewers drained {statistics.mean(idle) / seconds / 1e6:5.2f} MB/s each" if idle else ""
    return (
        f"rate={rate:>6}/s viewers={viewers:>3}  points/s per measured viewer={statistics.mean(measured) / seconds:>8,.0f}  "
        f"latency ms p50={pct(ms, 0.5):6.1f} p90={pct(ms, 0.9):6.1f} p99={pct(ms, 0.99):6.1f} max={pct(ms, 1.0):6.1f}  "
        f"(n={len(latencies):,}){drained}  connected in {connecting - SETTLE_S:.2f} s, left behind by the shared reader: {left}"
    )


def left_behind(stack: RunningStack) -> int:
    """Viewers the api's shared readers have left to read on their own so far (``/metrics``)."""
    found = re.search(r"^torchyard_live_feed_left_behind_total (\S+)$", stack.client.http.get("/metrics").text, re.M)
    return int(float(found.group(1))) if found else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, action="append", help="points/s the ranks log together (repeatable)")
    parser.add_argument("--viewers", type=int, action="append", help="SSE clients (repeatable)")
    parser.add_argument("--keys", type=int, default=5, help="scalars per log() call")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per rate and viewer count")
    args = parser.parse_args()
    viewers = args.viewers or [1, 100]
    results = []
    # the baseline, in the same run: a reader per viewer (TORCHYARD_LIVE_SHARED_FEED=0), for the most viewers
    for shared in (True, False):
        tmp = Path(tempfile.mkdtemp(prefix="ty-live-"))
        with sqlite_stack(tmp, max_streams_per_token=max(viewers) + 4, live_shared_feed=shared) as stack:
            for rate in args.rate or [1000, 10000]:
                for count in viewers if shared else [max(viewers)]:
                    label = "shared reader" if shared else "reader per viewer"
                    results.append(f"{label:<17} {one(stack, rate, count, args.keys, args.seconds)}")
                    print(results[-1], flush=True)
    print("\n".join(["", "live latency, log() → SSE client:", *results]))


if __name__ == "__main__":
    main()
