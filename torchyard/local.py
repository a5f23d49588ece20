"""``torchyard up``: the whole system on embedded defaults in one command: a private Redis (when
no TORCHYARD_REDIS_URL), SQLite under the state directory, the api with its scheduler, ingest
and one local worker. Ctrl-C stops every process it started, training ranks included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from torchyard.procs import RedisServer, wait_for
from torchyard.settings import Settings, settings_env

STOP_TIMEOUT_S = 15.0


def _install_admin_token(settings: Settings) -> str:
    """TORCHYARD_ADMIN_TOKEN if set, else the token this state directory already printed (still
    valid), else a new one: restarting `up` does not pile up admin tokens."""
    from sqlalchemy.orm import Session

    from backend.db import make_engine
    from backend.security import create_token, find_token

    saved = _saved_token(settings)
    engine = make_engine(settings.sqlalchemy_url)
    with Session(engine) as session, session.begin():
        if not settings.admin_token and saved and find_token(session, saved):
            value = saved
        else:
            value = create_token(session, "admin", "admin", settings.admin_token or None)[1]
    engine.dispose()
    return value


def _saved_token(settings: Settings) -> str | None:
    try:
        return str(json.loads(credentials_file(settings).read_text())["token"])
    except (OSError, ValueError, KeyError):
        return None


def credentials_file(settings: Settings) -> Path:
    return settings.state_dir / "credentials.json"


class Stack:
    def __init__(self, settings: Settings, processes: tuple[str, ...] = ("api", "ingest", "worker")) -> None:
        self.settings = settings
        self.processes = processes
        self.redis: RedisServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = threading.Event()

    def start(self) -> str:
        from backend.migrate import upgrade

        s = self.settings
        s.state_dir.mkdir(parents=True, exist_ok=True)
        redis_url = s.redis_url
        if not redis_url:
            self.redis = RedisServer(s.state_dir / "redis").start()
            redis_url = self.redis.url
        url = f"http://{s.host}:{s.port}"
        s = self.settings = s.model_copy(
            update={"redis_url": redis_url, "database_url": s.sqlalchemy_url, "api_url": url}
        )
        print(f"database: {s.sqlalchemy_url}\nredis:    {redis_url}", flush=True)
        upgrade(s.sqlalchemy_url)
        token = _install_admin_token(s)
        for name in self.processes:
            self.spawn(name)
        wait_for(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 60, "the api")
        credentials_file(s).write_text(json.dumps({"api_url": url, "token": token}))
        credentials_file(s).chmod(0o600)
        print(
            f"\ntorchyard is up: {url}/#/login?token={token}\nadmin token: {token}\n"
            f"(the CLI on this machine reads {credentials_file(s)})",
            flush=True,
        )
        return token

    def spawn(self, name: str) -> subprocess.Popen[bytes]:
        """Starts (or restarts) one of the stack's processes: ``torchyard <name>``."""
        env = {**os.environ, **settings_env(self.settings)}  # children see exactly this stack's settings
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "torchyard.cli", name], env=env)
        return self.procs[name]

    def wait(self) -> int:
        """Blocks until a signal or a child's death; returns the exit code for ``up``."""
        while not self.stopping.is_set():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    print(f"torchyard: {name} exited with {proc.returncode}; stopping", file=sys.stderr)
                    return 1
            self.stopping.wait(0.5)
        return 0

    def stop(self) -> None:
        self.stopping.set()
        # The worker ends its runs' process groups on shutdown; stop it first, then the rest.
        for name in ("worker", "api", "ingest"):
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._end_leftover_runs()
        if self.redis:
            self.redis.stop()

    def _end_leftover_runs(self) -> None:
        from workers import launcher

        launcher.end_recorded_attempts(self.settings)


def up(settings: Settings) -> int:
    stack = Stack(settings)

    def _on_signal(_signum: int, _frame: object) -> None:
        stack.stopping.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        stack.start()
        code = stack.wait()
    finally:
        print("torchyard: stopping", flush=True)
        stack.stop()
    return code
