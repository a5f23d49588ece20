"""``torchyard up``: the whole system on embedded defaults in one command: a private Redis (when
no TORCHYARD_REDIS_URL), SQLite under the state directory, the api with its scheduler, ingest
and one local worker. Quiet by default (no access log), the login link printed last (and again by
``torchyard url``). Ctrl-C stops every process it started, training ranks included, after saying
what becomes of each live run; a second Ctrl-C stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from cli.redis_server import RedisServer
from cli.wait import wait_for
from torchyard.settings import Settings, redact, secure_state_dir, settings_env

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


def login_link(api_url: str, token: str) -> str:
    return f"{api_url}/#/login?token={token}"


def progress(what: str) -> None:
    print(f"torchyard: {what}", flush=True)


def listed_nodes(api_url: str, token: str) -> list[dict[str, Any]]:
    """The nodes the api lists; an error answer (a database still busy with the migration: a 503
    whose body is ``{"detail": ...}``) raises, so a wait goes on and names it, and is never taken
    for the list."""
    response = httpx.get(f"{api_url}/api/v1/nodes", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    if response.status_code != 200:
        raise RuntimeError(f"GET /api/v1/nodes answered {response.status_code}: {response.text[:200]}")
    nodes = response.json()
    if not isinstance(nodes, list):
        raise RuntimeError(f"GET /api/v1/nodes answered no list: {response.text[:200]}")
    return nodes


class Stack:
    def __init__(
        self,
        settings: Settings,
        processes: tuple[str, ...] = ("api", "ingest", "worker"),
        *,
        redis_port: int | None = None,
        verbose: bool = True,
    ) -> None:
        self.settings = settings
        self.processes = processes
        self.redis_port = redis_port
        self.verbose = verbose  # the api's access log and the worker's INFO lines (quiet: warnings only)
        self.redis: RedisServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = threading.Event()
        self.hurry = threading.Event()  # a second Ctrl-C: no more waiting for saves

    def start(self) -> str:
        from backend.migrate import upgrade

        s = self.settings
        s.state_dir.mkdir(parents=True, exist_ok=True)
        redis_url = s.redis_url
        if not redis_url:
            progress("starting a private redis-server")
            self.redis = RedisServer(
                s.state_dir / "redis", port=self.redis_port, max_memory_bytes=s.redis_max_memory_bytes
            ).start()
            redis_url = self.redis.url
        url = f"http://{s.host}:{s.port}"
        s = self.settings = s.model_copy(
            update={"redis_url": redis_url, "database_url": s.sqlalchemy_url, "api_url": url}
        )
        print(f"database: {redact(s.sqlalchemy_url)}\nredis:    {redact(redis_url)}", flush=True)
        progress("migrating the database")
        upgrade(s.sqlalchemy_url)
        token = _install_admin_token(s)
        secure_state_dir(s)  # 0700, and the SQLite files 0600 (migrate may have just made them)
        progress(f"starting {', '.join(self.processes)}")
        for name in self.processes:
            self.spawn(name)
        wait_for(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 60, "the api")
        credentials_file(s).write_text(json.dumps({"api_url": url, "token": token}))
        credentials_file(s).chmod(0o600)
        nodes = ""
        if "worker" in self.processes:
            progress("waiting for the worker's first heartbeat")
            found = wait_for(lambda: listed_nodes(url, token), 60, "a node")
            nodes = "; ".join(f"node {n['id']}: {n['slots']} slots, {', '.join(n['devices'])}" for n in found)
        print(
            f"\ntorchyard is up{f' ({nodes})' if nodes else ''}\n"
            f"dashboard:   {login_link(url, token)}\nadmin token: {token}\n"
            f"(the CLI on this machine reads {credentials_file(s)}; `torchyard url` prints the link again; "
            "Ctrl-C stops everything)",
            flush=True,
        )
        return token

    def spawn(self, name: str) -> subprocess.Popen[bytes]:
        """Starts (or restarts) one of the stack's processes: ``torchyard <name>``."""
        env = {**os.environ, **settings_env(self.settings)}  # children see exactly this stack's settings
        quiet = {"api": ["--no-access-log", "--log-level", "warning"], "worker": ["--loglevel", "WARNING", "--quiet"]}
        args = [] if self.verbose else quiet.get(name, [])
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "cli.main", name, *args], env=env)
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
        from workers import launcher

        self.stopping.set()
        # The worker ends its runs' process groups on shutdown (ranks that save on cancel save
        # first, within their run's cancel grace); stop it first, then the api and ingest together.
        self._stop_together(("worker",), STOP_TIMEOUT_S + launcher.stop_grace_s(self.settings))
        self._stop_together(("api", "ingest"), STOP_TIMEOUT_S)
        launcher.end_recorded_attempts(self.settings)  # what a killed worker left
        if self.redis:
            self.redis.stop()

    def _stop_together(self, names: tuple[str, ...], timeout: float) -> None:
        """SIGTERM to each of these processes, then SIGKILL to any still there after ``timeout``
        (at once after a second Ctrl-C)."""
        procs = [proc for name in names if (proc := self.procs.get(name)) and proc.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not self.hurry.is_set():
            self.hurry.wait(0.05)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def live_runs_on_stop(settings: Settings) -> list[str]:
    """What stopping ``up`` does to each run this machine trains, in words, for the user to read
    before it happens: the worker ends the ranks, and the next ``up`` starts a new attempt (resumed
    from the newest checkpoint, one its ranks save on the way out when checkpoint_on_cancel)."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from backend.db import make_engine
    from backend.models import Run
    from torchyard.checkpoints import complete
    from torchyard.states import RunState

    engine = make_engine(settings.sqlalchemy_url)
    lines = []
    with Session(engine) as session:
        live = session.scalars(
            select(Run).where(Run.status.in_([RunState.SCHEDULED, RunState.RUNNING])).order_by(Run.id)
        )
        for run in live:
            training = run.run_spec.training
            saved = complete(settings.checkpoints / str(run.id))
            if len(run.attempts) >= training.max_attempts:
                what = f"fails: it has had its {training.max_attempts} attempt(s) (training.max_attempts)"
            elif training.checkpoint_on_cancel:
                what = "saves a checkpoint at its next step now, and resumes from it"
            elif saved:
                what = f"resumes from its checkpoint at step {saved[-1][0]}"
                if run.last_step > saved[-1][0]:
                    what += f" (steps {saved[-1][0] + 1}-{run.last_step} run again)"
            else:
                what = (
                    "has no checkpoint: it starts again from step 1 "
                    "(training.checkpoint_every or checkpoint_on_cancel keep its progress)"
                )
            lines.append(f"  run {run.id} {run.name!r} at step {run.last_step}: {what}")
    engine.dispose()
    return lines


def up(settings: Settings, *, redis_port: int | None = None, verbose: bool = False) -> int:
    stack = Stack(settings, redis_port=redis_port, verbose=verbose)

    def _on_signal(_signum: int, _frame: object) -> None:
        if stack.stopping.is_set():
            stack.hurry.set()
        stack.stopping.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        stack.start()
        code = stack.wait()
    finally:
        try:
            lines = live_runs_on_stop(stack.settings)
        except Exception as exc:  # a start that failed before the database was ready: nothing runs
            lines = [f"  (could not read the runs: {exc})"]
        print("torchyard: stopping (Ctrl-C again stops at once)", flush=True)
        if lines:
            print("when `torchyard up` starts again, each live run:\n" + "\n".join(lines), flush=True)
        stack.stop()
    return code
