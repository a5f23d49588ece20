"""The metrics SDK against a real, private redis-server: delivery, a Redis restart mid-run,
buffer overflow, bad values, and no configuration."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

import torchyard
from cli.redis_server import RedisServer
from cli.wait import wait_for
from torchyard import sdk, streams
from torchyard.net import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def metrics_entries(url: str, run_id: int) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(url)
    try:
        out = []
        entries: Any = client.xrange(streams.rank_stream(run_id))
        for _id, fields in entries:
            kind, data = streams.decode(fields)
            assert kind == streams.METRICS
            out.append(data)
        return out
    finally:
        client.close()


def point_counts(entries: list[dict[str, Any]]) -> Counter[tuple[int, int]]:
    return Counter((e["rank"], p[0]) for e in entries for p in e["points"])


def rank_env(url: str, run_id: int, rank: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_RANK_REDIS_URL=url, TORCHYARD_RUN_ID=str(run_id), TORCHYARD_ATTEMPT="3", RANK=str(rank))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def python(code: str, env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=ROOT,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )


@pytest.mark.timeout(60)
def test_two_ranks_deliver_every_point_before_exit(server: RedisServer) -> None:
    n = 20_000
    code = f"""
        import numpy as np, torchyard
        for step in range(1, {n} + 1):
            torchyard.log(step, loss=1.0 / step, acc=np.float32(0.5), nan=float("nan"))
        # no flush(): the exit handler must deliver everything
    """
    procs = [python(code, rank_env(server.url, 11, rank)) for rank in (0, 1)]
    for proc in procs:
        _out, err = proc.communicate(timeout=50)
        assert proc.returncode == 0, err
    entries = metrics_entries(server.url, 11)
    counts = point_counts(entries)
    expected = {(rank, step) for rank in (0, 1) for step in range(1, n + 1)}
    assert set(counts) == expected  # nothing missing, nothing extra
    assert all(c == 1 for c in counts.values())  # and, with Redis healthy, nothing twice
    assert all(e["attempt"] == 3 and e["dropped"] == 0 for e in entries)
    assert all(len(e["points"]) <= sdk.MAX_BATCH_POINTS for e in entries)
    step, ts, values = entries[0]["points"][0]
    assert step == 1 and abs(ts - time.time()) < 60
    assert values["loss"] == 1.0 and values["acc"] == 0.5 and values["nan"] != values["nan"]


@pytest.mark.timeout(60)
def test_redis_restart_mid_run_loses_nothing(server: RedisServer) -> None:
    writer = sdk._Writer(server.url, 12, attempt=1, rank=0)
    step = 0

    def log_some(count: int) -> None:
        nonlocal step
        for _ in range(count):
            step += 1
            writer.append(step, {"loss": float(step)})

    log_some(1000)
    wait_for(lambda: len(point_counts(metrics_entries(server.url, 12))) == 1000, 10, "the first points")

    server.stop()
    deadline = time.monotonic() + 20
    while writer.failures < 4:  # keep logging while Redis is down, until the writer has retried a few times
        log_some(100)
        time.sleep(0.01)  # pace the "training loop"; not a synchronisation
        assert time.monotonic() < deadline, "the writer never noticed Redis was down"
    log_some(1000)
    assert writer.pending() > 0

    server.start()  # same port, same data dir: the append-only file brings back the first points
    assert writer.flush(30)
    entries = metrics_entries(server.url, 12)
    counts = point_counts(entries)
    assert set(counts) == {(0, s) for s in range(1, step + 1)}
    assert max(counts.values()) == 1
    assert entries[-1]["dropped"] == 0 and writer.dropped == 0


class NoPeriods(threading.Event):
    """The writer's wake-up event with its periods taken away (the batch window, the idle safety
    net): a wait whose time is already up returns at once, any other lasts until something wakes
    the writer."""

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait(0) if timeout is not None and timeout <= 0 else super().wait()


@pytest.mark.timeout(60)
def test_a_point_after_a_quiet_spell_is_written_at_once(server: RedisServer) -> None:
    """Nagle-like: an idle writer is woken by the next point and writes it at once, alone, not
    after a period. Its periods never end here: a point that arrives at all woke the writer."""
    writer = sdk._Writer(server.url, 15, attempt=1, rank=0)
    writer._wake = NoPeriods()
    client = redis.Redis.from_url(server.url, socket_timeout=30)  # above XREAD's block
    last = "0-0"
    try:
        for step in range(1, 11):
            # the quiet spell: the writer has written everything and waits for the next point
            wait_for(lambda: writer._idle or writer._thread is None, 10, "the writer to go idle")
            writer.append(step, {"loss": 1.0})
            got: Any = client.xread({streams.rank_stream(15): last}, block=20_000)
            assert got, f"step {step} not written in 20 s: the point did not wake the idle writer"
            ((entry_id, fields),) = got[0][1]  # one write
            assert [p[0] for p in streams.decode(fields)[1]["points"]] == [step]  # of this point alone
            last = entry_id
    finally:
        client.close()


class HeldTransport:
    """The writer's Redis client (its transport, ``_Writer._client``) behind a gate the test holds:
    an XADD goes in and waits there, without error or reply, as on a hung Redis, until released."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.released = threading.Event()
        self.entered = threading.Event()
        self.calls = 0  # XADDs that went in
        self.returned = 0  # and came back

    def xadd(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.entered.set()
        if not self.released.wait(60):
            raise TimeoutError("the test never released the transport")
        result = self.client.xadd(*args, **kwargs)
        self.returned += 1
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


@pytest.mark.timeout(60)
def test_a_hung_redis_never_stalls_the_training_thread(server: RedisServer) -> None:
    """log() and log_timeline() only queue: while the writer's XADD hangs, every one of the training
    thread's calls returns, nothing is written, and everything arrives once the XADD goes through."""
    writer = sdk._Writer(server.url, 16, attempt=1, rank=0)
    writer.append(1, {"loss": 1.0})
    assert writer.flush(10)
    held = HeldTransport(writer._client)
    writer._client = held
    returned = []

    def training() -> None:
        for step in range(3, 2002):
            writer.append(step, {"loss": float(step)})
            if step % 500 == 0:
                writer.send_timeline(step, {"lanes": []})
            returned.append(step)

    try:
        writer.append(2, {"loss": 2.0})
        assert held.entered.wait(10), "the writer never tried to write step 2"
        thread = threading.Thread(target=training)
        thread.start()
        thread.join(30)  # a bound on a hang, not a measure: the calls never wait for the XADD
        assert not thread.is_alive() and len(returned) == 1999, f"{len(returned)} of 1999 calls returned"
        assert (held.calls, held.returned) == (1, 0)  # all of them while step 2's XADD hung
        assert writer.pending() == 2000  # steps 2..2001, none written, none dropped
    finally:
        held.released.set()
    assert writer.flush(30)
    assert held.returned == held.calls
    counts = point_counts([e for e in all_entries(server.url, 16) if "points" in e])
    assert set(counts) == {(0, s) for s in range(1, 2002)} and max(counts.values()) == 1
    assert [e["step"] for e in all_entries(server.url, 16) if "timeline" in e] == [500, 1000, 1500, 2000]


def all_entries(url: str, run_id: int) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(url)
    try:
        entries: Any = client.xrange(streams.rank_stream(run_id))
        return [streams.decode(fields)[1] for _id, fields in entries]
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_full_buffer_drops_oldest_and_counts_them(tmp_path: Path) -> None:
    port = free_port()
    srv = RedisServer(tmp_path / "redis", port=port)  # not started yet: the rank logs into the void
    code = """
        import sys, torchyard
        from torchyard import sdk
        for step in range(1, 251):
            torchyard.log(step, loss=float(step))
        print("logged", flush=True)
        sys.stdin.readline()
        print(torchyard.flush(20), sdk._writer.dropped, flush=True)
    """
    proc = python(code, rank_env(srv.url, 13, 1, TORCHYARD_SDK_BUFFER="100"))
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "logged"
        srv.start()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, err
        assert out.split() == ["True", "150"]
        assert "dropped" in err  # the warning
        entries = metrics_entries(srv.url, 13)
        counts = point_counts(entries)
        assert set(counts) == {(1, s) for s in range(151, 251)}  # the newest 100 survived
        assert entries[-1]["dropped"] == 150
    finally:
        proc.kill()
        srv.stop()


@pytest.mark.timeout(60)
def test_forked_child_keeps_its_own_buffer(server: RedisServer) -> None:
    code = """
        import os, torchyard
        for step in range(1, 11):
            torchyard.log(step, loss=1.0)
        pid = os.fork()
        if pid == 0:
            for step in range(11, 21):
                torchyard.log(step, loss=2.0)
            raise SystemExit(0)  # a normal exit: the child's exit handler flushes its own points
        for step in range(21, 31):
            torchyard.log(step, loss=3.0)
        assert os.waitpid(pid, 0)[1] == 0
    """
    proc = python(code, rank_env(server.url, 14, 0))
    _out, err = proc.communicate(timeout=50)
    assert proc.returncode == 0, err
    counts = point_counts(metrics_entries(server.url, 14))
    assert counts == Counter({(0, s): 1 for s in range(1, 31)})


def test_non_numbers_raise_type_error() -> None:
    with pytest.raises(TypeError, match="loss"):
        torchyard.log(1, loss="1.5")
    with pytest.raises(TypeError, match="loss"):
        torchyard.log(1, loss=None)
    with pytest.raises(TypeError, match="loss"):
        torchyard.log(1, loss=torch.ones(2))
    with pytest.raises(TypeError, match="step"):
        torchyard.log("1", loss=1.0)  # type: ignore[arg-type]
    assert sdk._scalar("x", np.float16(0.5)) == 0.5
    assert sdk._scalar("x", torch.tensor(2.5)) == 2.5
    assert sdk._scalar("x", np.int64(3)) == 3.0
    assert sdk._scalar("x", True) == 1.0
    assert sdk._scalar("x", float("inf")) == float("inf")


def unconfigured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHYARD_RANK_REDIS_URL", raising=False)
    monkeypatch.delenv("TORCHYARD_RUN_ID", raising=False)
    monkeypatch.setattr(sdk, "_writer", None)


def test_without_configuration_log_is_a_no_op_that_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    unconfigured(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10_000):
            torchyard.log(step, loss=0.5)
    assert len(caught) == 1 and "TORCHYARD_RANK_REDIS_URL" in str(caught[0].message)
    assert isinstance(sdk._writer, sdk._Disabled)
    assert torchyard.flush(1)


@pytest.mark.timing
def test_without_configuration_log_costs_microseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    unconfigured(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchyard.log(0, loss=0.5)  # the one warning, and the no-op writer, before the clock starts
        started = time.perf_counter()
        for step in range(10_000):
            torchyard.log(step, loss=0.5)
        elapsed = time.perf_counter() - started
    assert elapsed < 1.0, (
        f"10,000 unconfigured log() calls took {elapsed:.2f} s (µs each on an idle core); the bound assumes "
        "this process has a core to itself (the timing tier, run serially after the rest)"
    )


def test_a_batch_encoded_by_chunks_is_the_entry_encode_makes() -> None:
    points = [(step, 1.7e9 + step, {"loss": 1.0 / step, "nan": float("nan")}) for step in range(1, 301)]
    header = {"attempt": 2, "rank": 1, "dropped": 7}
    pauses = []
    chunked = streams.encode_metrics(header, points, pause=lambda: pauses.append(1), chunk=128)
    kind, data = streams.decode(chunked)
    assert kind == streams.METRICS and len(pauses) == 3  # 128 + 128 + 44 points, a pause after each
    _, whole = streams.decode(streams.encode(streams.METRICS, {**header, "points": points}))
    assert repr(data) == repr(whole)  # NaN != NaN: compare the decoded values' spelling
    assert streams.decode(streams.encode_metrics(header, [], pause=lambda: None))[1]["points"] == []
