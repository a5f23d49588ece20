"""A whole torchyard system for tests and benchmarks: api (+scheduler), ingest and a worker as real
processes on a database and a private Redis, a client that waits on conditions, and a finder for a
run's processes. Tests reach it through fixtures (``tests/conftest.py``); benchmarks import it
directly (they never import ``tests``)."""

from __future__ import annotations

import io
import uuid
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import sqlalchemy

from cli import sse
from cli.local import Stack
from cli.redis_server import RedisServer
from cli.wait import wait_for
from torchyard.net import free_port
from torchyard.settings import Settings
from torchyard.states import TERMINAL


class Client:
    """The api as a test sees it: a bearer token and helpers that wait on conditions."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def submit(self, **overrides: Any) -> dict[str, Any]:
        response = self.http.post("/api/v1/runs", json=run_spec(**overrides))
        assert response.status_code == 201, response.text
        return dict(response.json())

    def upload(self, files: dict[str, str]) -> str:
        """A bundle of these files (name → text), uploaded: its id."""
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            for name, text in files.items():
                zf.writestr(name, text)
        response = self.http.post("/api/v1/bundles", files={"file": ("code.zip", buf.getvalue())})
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def submit_script(
        self, name: str, entry: str, script: str, procs: int = 1, device: str = "cpu", **training: Any
    ) -> dict[str, Any]:
        """A run of one user script (uploaded as its own bundle), on one node."""
        spec = {
            "name": name,
            "workload": {"kind": "script", "bundle": self.upload({entry: script}), "entry": entry},
            "resources": {"nodes": 1, "procs_per_node": procs, "device": device},
            "training": training,
        }
        response = self.http.post("/api/v1/runs", json=spec)
        assert response.status_code == 201, response.text
        return dict(response.json())

    def log_lines(self, run_id: int, contains: str, count: int) -> list[str]:
        """The run's log lines holding ``contains``, once ``count`` of them are in (ingest may lag the end)."""
        found: list[str] = []

        def enough() -> bool:
            lines = self.http.get(f"/api/v1/runs/{run_id}/logs", params={"limit": 5000, "contains": contains})
            found[:] = [line["text"] for line in lines.json()]
            return len(found) >= count

        wait_for(enough, 30, f"{count} lines of run {run_id} with {contains!r}", interval=0.5)
        return found

    def log_tail(self, run_id: int, lines: int = 60) -> str:
        """The run's last log lines, for a failure message (CI keeps no run's log otherwise)."""
        tail = self.http.get(f"/api/v1/runs/{run_id}/logs", params={"tail": True, "limit": lines}).json()
        return "".join(f"  [rank {line['rank']}] {line['text']}\n" for line in tail)

    def run(self, run_id: int) -> dict[str, Any]:
        return dict(self.http.get(f"/api/v1/runs/{run_id}").raise_for_status().json())

    def wait_status(self, run_id: int, statuses: set[str], timeout: float = 90) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            run = self.run(run_id)
            if run["status"] in TERMINAL and run["status"] not in statuses:
                raise AssertionError(
                    f"run {run_id} ended {run['status']}: {run['status_reason']}\n{self.log_tail(run_id)}"
                )
            return run if run["status"] in statuses else None

        return wait_for(reached, timeout, f"run {run_id} to become {'/'.join(sorted(statuses))}", interval=0.2)


def run_spec(
    name: str = "test-run",
    workload: str = "mlp",
    params: dict[str, Any] | None = None,
    procs: int = 2,
    steps: int = 50,
    batch_size: int = 64,
    **training: Any,
) -> dict[str, Any]:
    return {
        "name": name,
        "workload": {"kind": "builtin", "name": workload, "params": params or {}},
        "strategy": {"kind": "ddp"},
        "resources": {"nodes": 1, "procs_per_node": procs, "device": "cpu"},
        "training": {"steps": steps, "batch_size": batch_size, "lr": 0.01, "seed": 0, **training},
    }


# ``run_spec`` (or ``Client.submit``) arguments for a run that trains until the test stops it, at a
# few % of a core a rank: the fail workload's tiny mlp, never failing, sleeping STEP_S a step in its
# compute. An mlp training flat out takes a whole core per rank, for as long as a test holds it, from
# every other test on the machine; a test of a cancel, a reconnect or a time limit needs a run that
# steps, not one that steps fast.
STEP_S = 0.02


def paced(steps: int, step_s: float = STEP_S) -> dict[str, Any]:
    """A run of ``steps`` steps of at least ``step_s`` each: one that must still be training when the
    test acts on it lasts ``steps × step_s`` at least, however fast the machine, at a few % of a core."""
    return {"workload": "fail", "steps": steps, "params": {"at_step": 1, "slow_s": step_s, "slow_in": "compute"}}


UNTIL_STOPPED = paced(10_000_000)


# A tiny model and few steps: a sweep's trial is mostly torchrun's start-up (about 5 s here).
SWEEP_PARAMS = {"hidden": 16, "layers": 1, "samples": 256}


def sweep_spec(steps: int = 6, procs: int = 2, **overrides: Any) -> dict[str, Any]:
    """A sweep of 4 random trials, 2 at once, over the lr of a ``procs``-rank run of the tiny mlp
    (a test of what the sweep controller does, not of the trials' ranks, takes 1: a rank costs ~3 s
    of CPU to start, mostly importing torch)."""
    return {
        "name": "lr-sweep",
        "base": run_spec(name="base", procs=procs, steps=steps, batch_size=32, params=SWEEP_PARAMS),
        "space": {"training.lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True}},
        "objective": {"metric": "loss", "direction": "minimize", "take": "last"},
        "n_trials": 4,
        "max_concurrent": 2,
        "sampler": "random",
        "pruner": {"kind": "none"},
        "seed": 0,
        **overrides,
    }


def submit_on_nodes(
    client: Client, name: str, nodes: int, procs: int, resources: dict[str, Any] | None = None, **training: Any
) -> int:
    """A run of the small mlp (or of ``workload`` and ``params``) on ``nodes`` × ``procs`` (multi-node tests);
    ``resources`` adds to its resources."""
    params = training.pop("params", {"hidden": 32})
    spec = run_spec(name=name, procs=procs, params=params, **training)
    spec["resources"].update(nodes=nodes, **(resources or {}))
    response = client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def mean_loss(client: Client, run_id: int) -> list[float]:
    """The run's loss per step, the mean over its ranks."""
    series = client.http.get(f"/api/v1/runs/{run_id}/metrics", params={"key": "loss"}).json()
    return [float(v) for v in series["aggregate"]["mean"]]


class RunningStack:
    def __init__(self, stack: Stack, token: str, redis: RedisServer | None = None) -> None:
        self.stack, self.token, self.redis = stack, token, redis
        self.settings = stack.settings
        self.url = stack.settings.api_url
        self.client = Client(self.url, token)


def start_stack(tmp: Path, database_url: str, redis: RedisServer, **overrides: Any) -> RunningStack:
    settings = Settings(
        state_dir=tmp / "state",
        database_url=database_url,
        redis_url=redis.url,
        port=free_port(),
        admin_token=f"ty_test_{uuid.uuid4().hex}",
        node_id=f"node-{uuid.uuid4().hex[:6]}",
        node_slots=4,
        heartbeat_s=0.5,
        node_timeout_s=5,
        scheduler_interval_s=0.5,
        **overrides,
    )
    stack = Stack(settings)
    token = stack.start()
    return RunningStack(stack, token, redis)  # start() waited for the worker's first heartbeat


@contextmanager
def sqlite_stack(tmp: Path, **overrides: Any) -> Iterator[RunningStack]:
    """A whole system on SQLite with a Redis of its own; every process of it (ranks too) ends on exit."""
    redis = RedisServer(tmp / "redis").start()
    try:
        running = start_stack(tmp, f"sqlite:///{tmp / 'torchyard.db'}", redis, **overrides)
        try:
            yield running
        finally:
            running.stack.stop()
    finally:
        redis.stop()


@contextmanager
def api_only_stack(tmp: Path, **overrides: Any) -> Iterator[RunningStack]:
    """The api alone (its scheduler too) on SQLite with a Redis of its own: no ingest, no worker, so
    a submitted run waits (what the CLI tells its user, what the fuzzer needs to be fast)."""
    redis = RedisServer(tmp / "redis").start()
    token = f"ty_test_{uuid.uuid4().hex}"
    settings = Settings(
        state_dir=tmp / "state", database_url=f"sqlite:///{tmp / 'db.sqlite'}", redis_url=redis.url,
        port=free_port(), admin_token=token, **overrides,
    )  # fmt: skip
    stack = Stack(settings, processes=("api",))
    try:
        stack.start()
        try:
            yield RunningStack(stack, token, redis)
        finally:
            stack.stop()
    finally:
        redis.stop()


def read_sse(
    stack: RunningStack,
    run_id: int,
    last_event_id: str | None = None,
    limit: int | None = None,
    on_event: Callable[[sse.Event], None] | None = None,
) -> list[sse.Event]:
    """Every event until the server ends the stream or ``limit`` is reached."""
    headers = {"Authorization": f"Bearer {stack.token}"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    events: list[sse.Event] = []
    url = f"{stack.url}/api/v1/runs/{run_id}/stream"
    with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(30, read=60)) as response:
        assert response.status_code == 200, response.read()
        for event in sse.parse(response.iter_lines()):
            events.append(event)
            if on_event:
                on_event(event)
            if limit and len(events) >= limit:
                break
    return events


def run_processes(run_id: int, checkpoint_root: Path) -> list[psutil.Process]:
    """Every live process of the stack's run (the launcher gives each its run id and checkpoint
    directory): run ids are small numbers, and other stacks on the machine have runs of the same
    ids; ``checkpoint_root`` (the stack's ``settings.checkpoints``) tells this stack's apart."""
    mine = str(checkpoint_root / str(run_id))
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            environ = proc.environ()
            if (
                environ.get("TORCHYARD_RUN_ID") == str(run_id)
                and environ.get("TORCHYARD_CHECKPOINT_DIR") == mine
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def metric_rows(settings: Settings, run_id: int) -> Counter[tuple[int, int, str, int]]:
    """How many stored rows each (attempt, rank, key, step) of the run has, read from the database
    itself: the api's series keep one value per rank and step, so only a row count shows a double."""
    engine = sqlalchemy.create_engine(settings.sqlalchemy_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sqlalchemy.text("SELECT attempt, rank, key, step FROM metrics WHERE run_id = :run"), {"run": run_id}
            )
            return Counter((int(a), int(r), str(k), int(s)) for a, r, k, s in rows)
    finally:
        engine.dispose()


def row_gaps(rows: Counter[tuple[int, int, str, int]], steps: int, ranks: int, keys: set[str]) -> list[str]:
    """What is wrong with a run's stored points: any row stored twice (an assertion: it can never
    heal), and each (rank, key) whose attempts together miss a step of 1..``steps`` (returned: it
    may still be on its way). A resumed attempt re-logs the steps after its checkpoint: each
    attempt has each step at most once, the attempts together every step."""
    doubled = [point for point, count in rows.items() if count > 1]
    assert not doubled, f"{len(doubled)} points stored twice, e.g. (attempt, rank, key, step) {sorted(doubled)[:5]}"
    covered: dict[tuple[int, str], set[int]] = {}
    for _attempt, rank, key, step in rows:
        covered.setdefault((rank, key), set()).add(step)
    gaps = []
    for rank in range(ranks):
        for key in sorted(keys):
            missing = set(range(1, steps + 1)) - covered.get((rank, key), set())
            if missing:
                gaps.append(f"{key} rank {rank}: {len(missing)} steps missing {sorted(missing)[:10]}")
    return gaps
