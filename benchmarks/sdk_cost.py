"""What ``torchyard.log()`` costs the training thread, and how soon a point reaches Redis, with Redis
up, down (its process stopped: connections refused) and hung (SIGSTOP: connections hang, no error).

    python -m benchmarks.sdk_cost [--rate 2000] [--keys 8] [--seconds 4]

A "training loop" calls ``log(step, **keys)`` ``--rate`` times a second for ``--seconds`` in each
phase (paced, as steps are); each call is timed with ``perf_counter_ns``. With Redis up, a reader
blocked on the stream (XREAD) times each point's arrival against the time ``log()`` stamped on it:
the SDK's share of live latency. After the down and hung phases Redis comes back and every point
must arrive exactly once (counted). Goals (issue 13): ``log()`` p50 ≤ 20 µs and never over 1 ms;
a point in Redis within ~a round trip when the writer was idle, within the 20 ms batch window
under load. "in a GC": calls over 1 ms during which CPython collected garbage (the interpreter's
pause, whatever line it lands in; with ``gc`` off no call of the outage phases passed 0.3 ms)."""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from cli.redis_server import RedisServer
from torchyard import sdk, streams

RUN_ID = 424242


class Collections:
    """CPython's garbage collections (``gc.callbacks``): each runs in whatever line allocated last,
    often log() in this loop, and a full one walks every object of the process (~14 ms here). A
    call over 1 ms that held one is the interpreter's pause, not the SDK's: counted apart."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        self._start = 0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        else:
            self.spans.append((self._start, time.perf_counter_ns()))

    def held(self, start: int, cost: int) -> bool:
        return any(start <= end and begin <= start + cost for begin, end in self.spans)


COLLECTIONS = Collections()


def pace(rate: float, seconds: float, keys: dict[str, float], first_step: int) -> tuple[list[int], int]:
    """Calls log() ``rate`` times a second; returns each call's ns (negative: a call that held a
    garbage collection) and the next step."""
    costs, step = [], first_step
    period = 1.0 / rate
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        target = start + i * period
        while (now := time.perf_counter()) < target:  # spin: a sleep would oversleep by ~0.1 ms
            if target - now > 0.002:
                time.sleep(target - now - 0.001)
        t0 = time.perf_counter_ns()
        sdk.log(step, **keys)
        cost = time.perf_counter_ns() - t0
        costs.append(-cost if cost > 1_000_000 and COLLECTIONS.held(t0, cost) else cost)
        step += 1
    return costs, step


def delivery_reader(url: str, last: str, stop: Any, out: Any) -> None:
    """In a process of its own (its decoding would take the GIL from the timed loop): the delay
    from each point's log() to its arrival in Redis, read from after entry ``last``."""
    client = redis.Redis.from_url(url)
    delays: list[float] = []
    while not stop.is_set():
        got: Any = client.xread({streams.rank_stream(RUN_ID): last}, block=200)
        now = time.time()
        for _stream, entries in got or []:
            for entry_id, fields in entries:
                last = entry_id
                kind, entry = streams.decode(fields)
                if kind == streams.METRICS:
                    delays.extend(now - ts for _step, ts, _values in entry["points"])
    client.close()
    out.put(delays)


class Reader:
    def __init__(self, url: str) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process whose SDK thread runs
        client = redis.Redis.from_url(url)
        newest: Any = client.xrevrange(streams.rank_stream(RUN_ID), count=1)
        client.close()
        self.stop, self.out = ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(
            target=delivery_reader, args=(url, newest[0][0].decode() if newest else "0-0", self.stop, self.out)
        )
        self.proc.start()
        time.sleep(1.5)  # the reader has started and blocks on the stream (a spawn imports for ~1 s)

    def delays(self) -> list[float]:
        self.stop.set()
        got: list[float] = self.out.get(timeout=30)
        self.proc.join(10)
        return got


def stats_us(costs: list[int]) -> tuple[float, float, float]:
    xs = sorted(costs)
    return xs[len(xs) // 2] / 1e3, xs[int(len(xs) * 0.99)] / 1e3, xs[-1] / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=2000, help="log() calls per second (default 2000)")
    parser.add_argument("--keys", type=int, default=8, help="values per call (default 8)")
    parser.add_argument("--seconds", type=float, default=4, help="per phase (default 4)")
    args = parser.parse_args()
    server = RedisServer(Path(tempfile.mkdtemp(prefix="sdk-cost-redis-"))).start()
    os.environ.update(TORCHYARD_RANK_REDIS_URL=server.url, TORCHYARD_RUN_ID=str(RUN_ID), RANK="0")
    keys = {f"k{i}": float(i) for i in range(args.keys)}
    rows = []
    try:
        sdk.log(0, warmup=1.0)  # the writer thread and its connection exist before timing
        assert sdk.flush(10)
        # Idle: one point after a quiet spell, as a slow training step logs.
        reader = Reader(server.url)
        step = 1
        for _ in range(20):
            sdk.log(step, **keys)
            step += 1
            time.sleep(0.05)
        assert sdk.flush(10)
        idle_delays = reader.delays()
        reader = Reader(server.url)
        costs, step = pace(args.rate, args.seconds, keys, step)
        assert sdk.flush(10)
        rows.append(("redis up", costs, idle_delays, reader.delays()))

        server.stop()  # down: connection refused, the writer backs off and keeps the points
        costs, step = pace(args.rate, args.seconds, keys, step)
        server.start()
        rows.append(("redis down", costs, [], []))

        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # hung: the writer's XADD waits on its socket
        try:
            costs, step = pace(args.rate, args.seconds, keys, step)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        rows.append(("redis hung", costs, [], []))
        delivered = sdk.flush(60)

        client = redis.Redis.from_url(server.url)
        entries: Any = client.xrange(streams.rank_stream(RUN_ID))
        client.close()
        counts = Counter(p[0] for _id, f in entries for p in streams.decode(f)[1].get("points", []))
        logged = set(range(0, step))
        lost, doubled = len(logged - set(counts)), sum(1 for c in counts.values() if c > 1)
    finally:
        server.stop()

    print(f"log() with {args.keys} values, {args.rate:.0f} calls/s, {args.seconds:.0f} s per phase")
    print(
        f"{'phase':<12} {'calls':>7} {'p50 µs':>8} {'p99 µs':>8} {'max µs':>9} {'over 1 ms':>9} {'in a GC':>8}  delivery"
    )
    for name, signed, idle, load in rows:
        costs = [abs(c) for c in signed]
        p50, p99, worst = stats_us(costs)
        over = sum(1 for c in costs if c > 1_000_000)
        in_gc = sum(1 for c in signed if c < 0)
        shown = ""
        if idle:
            shown = f"idle: median {statistics.median(idle) * 1e3:.1f} ms, max {max(idle) * 1e3:.1f} ms"
        if load:
            xs = sorted(load)
            shown += (
                f"; under load: p50 {xs[len(xs) // 2] * 1e3:.1f} ms, p99 {xs[int(len(xs) * 0.99)] * 1e3:.1f} ms, "
                f"max {xs[-1] * 1e3:.1f} ms"
            )
        print(f"{name:<12} {len(costs):>7} {p50:>8.1f} {p99:>8.1f} {worst:>9.1f} {over:>9} {in_gc:>8}  {shown}")
    print(
        f"after the outages: every point delivered: {delivered}; {len(logged)} logged, {lost} lost, "
        f"{doubled} in the stream twice (a write that timed out on the hung server and was retried; "
        "ingest's unique index keeps one)"
    )


if __name__ == "__main__":
    main()
