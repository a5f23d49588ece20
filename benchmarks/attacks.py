"""Attacks from inside a submitted script, against a live stack: does the rank wall hold?

``python -m benchmarks.attacks`` starts a fresh stack (SQLite, a private Redis with ACLs, api,
ingest, one worker), runs two victim runs (another member's: one training, one leaving a secret in
/tmp, /var/tmp and /dev/shm, :data:`TEMP_OWNER_SCRIPT`) and an attacker run whose script tries
each attack listed in ISSUE 10 and prints what happened to its own log, then prints a table:
attack, held/broken. ``tests/security`` runs the same scenario (:func:`run_scenario`) and asserts
every attack held, the victim finished with each of its steps exactly once and the other found its
temp files intact.

The attacker's script (:data:`ATTACK_SCRIPT`) is a plain Python file uploaded as a bundle and
run as a ``script`` workload: it learns the targets from its arguments (what a hostile user
could find out: pids from ``ps`` on a shared host, the state dir's conventional path, the next
run id) and uses only what the platform hands a rank (its environment)."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from cli.wait import wait_for
from testkit.stack import paced, sqlite_stack
from torchyard.settings import Settings
from torchyard.states import TERMINAL
from workers import rundirs

RESULT_PREFIX = "TORCHYARD-ATTACK|"
TEMP_PREFIX = "TORCHYARD-TEMP|"  # run A's line with the sizes of its /tmp and /dev/shm
# Attacks that only a root worker's isolation stops (run user, namespaces); the Redis ones hold everywhere.
NEEDS_ROOT = frozenset(
    {
        "read state dir",
        "read credentials.json",
        "read secret_key",
        "read the database",
        "read Redis' platform password",
        "read /proc/<pid>/environ of api/ingest/worker",
        "kill another run's ranks",
        "write installed source",
        *(f"read another run's file in {place}" for place in ("/tmp", "/var/tmp", "/dev/shm")),
    }
)
TEMP_PLACES = ("/tmp", "/var/tmp", "/dev/shm")

ATTACK_SCRIPT = r'''
"""Tries every attack on the platform a rank can try; prints one result line per attack."""
import json, os, signal, sys

PREFIX = "TORCHYARD-ATTACK|"
targets = json.loads(sys.argv[1])


def result(name, outcome, detail):
    print(PREFIX + json.dumps({"attack": name, "outcome": outcome, "detail": str(detail)[:300]}), flush=True)


def attempt(name, fn):
    """outcome 'done' when fn ran without error (the wall did not stop it), else 'refused'."""
    try:
        detail = fn()
    except Exception as exc:  # noqa: BLE001 -- every refusal is a result
        result(name, "refused", f"{type(exc).__name__}: {exc}")
    else:
        result(name, "done", detail)


def read(path):
    with open(path, "rb") as f:
        return f"read {len(f.read())} bytes of {path}"


def all_of(fn, items):
    """Done if fn succeeded on any item (one is enough to break the wall)."""
    errors = []
    for item in items:
        try:
            return fn(item)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{item}: {type(exc).__name__}: {exc}")
    raise PermissionError("; ".join(errors) or "no targets")


state = targets["state_dir"]
attempt("read state dir", lambda: os.listdir(state))
attempt("read credentials.json", lambda: read(os.path.join(state, "credentials.json")))
attempt("read secret_key", lambda: read(os.path.join(state, "secret_key")))
attempt("read the database", lambda: read(targets["database"]))
attempt("read Redis' platform password", lambda: read(targets["redis_password_file"]))
attempt("read /proc/<pid>/environ of api/ingest/worker",
        lambda: all_of(lambda pid: read(f"/proc/{pid}/environ"), targets["platform_pids"]))
attempt("kill another run's ranks", lambda: all_of(lambda pid: os.kill(pid, signal.SIGKILL), targets["victim_pids"]))


def write_source():
    with open(targets["source_file"], "a"):  # opening for append proves it; nothing is written
        return f"opened {targets['source_file']} for writing"


attempt("write installed source", write_source)


def other_runs_file(path):
    if os.path.basename(path) in os.listdir(os.path.dirname(path)):
        return f"{path} is listed in its folder"  # seeing its name is a leak already
    return read(path)


for place, path in targets["other_runs_temp"].items():
    attempt(f"read another run's file in {place}", lambda path=path: other_runs_file(path))
leaked = sorted(k for k in os.environ if k in {
    "TORCHYARD_REDIS_URL", "TORCHYARD_DATABASE_URL", "TORCHYARD_SECRET_KEY", "TORCHYARD_TOKEN",
    "TORCHYARD_ADMIN_TOKEN", "TORCHYARD_STATE_DIR"})


def env_secrets():
    if leaked:
        return f"platform settings in the rank's environment: {leaked}"
    raise KeyError("no such env var: none of the platform's settings is in the environment")


attempt("platform secrets in the environment", env_secrets)

import redis  # noqa: E402  (the platform's own interpreter: redis-py is there)

url = os.environ["TORCHYARD_RANK_REDIS_URL"]
mine = redis.Redis.from_url(url, socket_timeout=5, protocol=2, driver_info=None)
victim, nxt = targets["victim_run"], targets["next_run"]


def entry(kind, data):
    return {"type": kind, "data": json.dumps(data)}


forged_report = {"attempt": 1, "node": targets["node_id"], "event": "exited", "status": "succeeded",
                 "returncode": 0, "reason": "FORGED"}
attempt("XADD a report into another run's stream", lambda: mine.xadd(f"ty:run:{victim}", entry("report", forged_report)))
attempt("XADD metrics into another run's stream",
        lambda: mine.xadd(f"ty:run:{victim}:in", entry("metrics", {"attempt": 1, "rank": 0, "dropped": 0,
                                                                   "points": [[1, 0.0, {"loss": 1e9}]]})))
attempt("XADD logs into another run's stream",
        lambda: mine.xadd(f"ty:run:{victim}", entry("logs", {"attempt": 1, "lines": [[0, 0.0, "FORGED"]]})))
attempt("pre-plant a report into the next run's stream",
        lambda: [mine.xadd(f"ty:run:{nxt}{s}", entry("report", {**forged_report, "status": "failed"})) for s in ("", ":in")])
attempt("SET another run's cancel key", lambda: mine.set(f"ty:cancel:{victim}", "1"))
attempt("SADD a non-stream into ty:streams:active",
        lambda: (mine.sadd("ty:streams:active", "ty:evil"), mine.set("ty:evil", "x")))
attempt("squat the scheduler leader key", lambda: mine.set("ty:scheduler:leader", "evil", ex=3600))
fake_beat = {"host": "10.6.6.6", "slots": 64, "devices": ["cpu", "cuda"], "ts": 4e9, "pid": 1}
attempt("register a fake node",
        lambda: (mine.set("ty:node:evil", json.dumps(fake_beat)), mine.sadd("ty:nodes", "evil")))
attempt("read any key (GET, XREAD, KEYS)", lambda: (mine.keys("*"), mine.xread({f"ty:run:{victim}": "0"})))


def no_password():
    host = url.rsplit("@", 1)[1].split("/")[0]
    return redis.Redis.from_url(f"redis://{host}/0", socket_timeout=5).ping()


attempt("use Redis without a password (default user)", no_password)


def celery_shutdown():
    from celery import Celery

    app = Celery(broker=url)
    app.conf.broker_connection_retry_on_startup = False
    app.conf.broker_connection_max_retries = 0
    return app.control.broadcast("shutdown")


attempt("Celery broadcast('shutdown')", celery_shutdown)
# Its own rank stream: Redis lets it write there, so ingest must refuse what a rank may not send.
attempt("XADD a forged report into its own rank stream",
        lambda: mine.xadd(f"ty:run:{targets['own_run']}:in", entry("report", {**forged_report, "status": "failed",
                                                                             "attempt": 1})))
attempt("XADD metrics as rank 99 / attempt 7 into its own rank stream",
        lambda: [mine.xadd(f"ty:run:{targets['own_run']}:in", entry("metrics", {"attempt": a, "rank": r, "dropped": 0,
                 "points": [[1, 0.0, {"loss": 1.0}]]})) for a, r in ((1, 99), (7, 0))])
print("attacks done", flush=True)
'''


# Run A, another member's: leaves a secret in each temp place for the attacker to look for, has its
# DataLoader workers pass batches through /dev/shm, holds until the harness releases it (a file in its
# cwd), and checks its secrets are still there: a private /tmp must not break the run that owns it.
TEMP_OWNER_SCRIPT = r"""
import json, os, sys, time

secrets = json.loads(sys.argv[1])  # path -> text
for path, text in secrets.items():
    with open(path, "w") as f:
        f.write(text)
sizes = {p: os.statvfs(p).f_blocks * os.statvfs(p).f_frsize for p in ("/tmp", "/dev/shm")}
print("TORCHYARD-TEMP|" + json.dumps(sizes), flush=True)

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

loader = DataLoader(TensorDataset(torch.arange(4096.0).reshape(512, 8)), batch_size=64, num_workers=2)
assert sum(batch.sum().item() for (batch,) in loader) == sum(range(4096))
deadline = time.monotonic() + float(sys.argv[2])
while not os.path.exists("release") and time.monotonic() < deadline:
    time.sleep(0.1)
for path, text in secrets.items():
    with open(path) as f:
        assert f.read() == text, path
print("temp files intact", flush=True)
"""
TEMP_HOLD_S = 120  # the longest run A waits for its release


def bundle_bytes(name: str = "attack.py", script: str = ATTACK_SCRIPT) -> bytes:
    """A bundle of one script (the attacker's by default)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(name, script)
    return buf.getvalue()


def script_spec(name: str, bundle_id: str, entry: str, args: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "workload": {"kind": "script", "bundle": bundle_id, "entry": entry, "args": args},
        "strategy": {"kind": "ddp"},
        "resources": {"nodes": 1, "procs_per_node": 1, "device": "cpu"},
        "training": {"steps": 1, "batch_size": 1, "lr": 0.01, "seed": 0},
    }


# How each attack's "done"/"refused" from the script becomes held/broken. Most are simply
# refused; writes into the attacker's own rank stream are allowed by Redis by design, and held
# means ingest refused them (checked by the harness: the attacker's run is not failed by its own
# forged report, and no rank-99/attempt-7 point was stored).
ALLOWED_BY_DESIGN = frozenset(
    {"XADD a forged report into its own rank stream", "XADD metrics as rank 99 / attempt 7 into its own rank stream"}
)


@dataclass
class Outcome:
    attack: str
    held: bool
    detail: str


@dataclass
class Scenario:
    results: list[Outcome] = field(default_factory=list)
    victim: dict[str, Any] = field(default_factory=dict)
    attacker: dict[str, Any] = field(default_factory=dict)
    victim_steps: int = 0
    victim_rows: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, step) -> rows of 'loss'
    temp_owner: dict[str, Any] = field(default_factory=dict)  # run A of the temp-space attacks, as it ended
    temp_sizes: dict[str, int] = field(default_factory=dict)  # the sizes of run A's /tmp and /dev/shm
    worker_alive: bool = False


def run_pids(run_id: int, worker_pid: int) -> list[int]:
    """Pids of the processes of a run under this stack's worker (run ids repeat across stacks on
    one machine; root reads any process' environment)."""
    marker = f"TORCHYARD_RUN_ID={run_id}".encode()
    pids = []
    try:
        descendants = psutil.Process(worker_pid).children(recursive=True)
    except psutil.Error:
        return []
    for proc in descendants:
        try:
            if marker in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0"):
                pids.append(proc.pid)
        except OSError:
            continue
    return pids


def _client(url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _member(admin: httpx.Client, name: str) -> httpx.Client:
    response = admin.post("/api/v1/tokens", json={"name": name, "role": "member"})
    response.raise_for_status()
    return _client(str(admin.base_url), response.json()["token"])


def _wait_terminal(client: httpx.Client, run_id: int, timeout: float) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        run = client.get(f"/api/v1/runs/{run_id}").raise_for_status().json()
        return dict(run) if run["status"] in TERMINAL else None

    return wait_for(done, timeout, f"run {run_id} to end", interval=0.3)


# The victim must still be training when the last attack is done (~25 s after it first steps here
# under load). Its steps are paced by a sleep (``testkit.stack.paced``: the `fail` workload's slow_s):
# its life has a floor of VICTIM_STEPS × VICTIM_PACE_S (45 s) that a fast machine does not shorten,
# and its 2 × 1,500 rank-steps cost a quarter of the CPU that 6,000 unpaced ones took to last as long.
VICTIM_STEPS, VICTIM_PACE_S = 1500, 0.03


def victim_spec(steps: int) -> dict[str, Any]:
    return {
        "name": "victim",
        "workload": {"kind": "builtin", "name": "fail", "params": paced(steps, VICTIM_PACE_S)["params"]},
        "strategy": {"kind": "ddp"},
        "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu"},
        "training": {"steps": steps, "batch_size": 64, "lr": 0.01, "seed": 0},
    }


def run_scenario(
    settings: Settings,
    admin_token: str,
    database_file: Path,
    redis_password_file: Path,
    platform_pids: list[int],
    worker_pid: int,
    count_rows: Any,
    victim_steps: int = VICTIM_STEPS,
    timeout: float = 240,
) -> Scenario:
    """Victim runs (member A: a training run, and one that leaves files in its temp space) and the
    attacker's run (member B) at once, on the stack of ``settings``; returns every attack's
    outcome. ``count_rows(run_id)`` → {(rank, step): rows of key 'loss'} (the harness reads the
    database)."""
    deadline = time.monotonic() + timeout
    admin = _client(settings.api_url, admin_token)
    tag = uuid.uuid4().hex[:6]
    victim_api, attacker_api = _member(admin, f"victim-{tag}"), _member(admin, f"attacker-{tag}")
    out = Scenario(victim_steps=victim_steps)
    victim = victim_api.post("/api/v1/runs", json=victim_spec(victim_steps)).raise_for_status().json()
    temp_owner = TempOwner.start(victim_api, tag)

    def training() -> list[int] | None:
        run = victim_api.get(f"/api/v1/runs/{victim['id']}").json()
        if run["status"] in TERMINAL:
            raise AssertionError(f"the victim ended before the attack: {run['status']} {run['status_reason']}")
        ranks = [p for p in run_pids(victim["id"], worker_pid) if _is_rank(p)]
        return ranks if run["last_step"] > 0 and len(ranks) >= 2 else None

    victim_pids = wait_for(training, max(10.0, deadline - time.monotonic()), "the victim's ranks to train")
    temp_owner.wait_planted(max(10.0, deadline - time.monotonic()))
    bundle = attacker_api.post("/api/v1/bundles", files={"file": ("attack.zip", bundle_bytes())})
    bundle.raise_for_status()
    own = temp_owner.run["id"] + 1  # what the attacker's id will be: its script is told (it could guess it)
    targets = {
        "state_dir": str(settings.state_dir),
        "database": str(database_file),
        "redis_password_file": str(redis_password_file),
        "platform_pids": platform_pids,
        "victim_pids": victim_pids,
        "victim_run": victim["id"],
        "own_run": own,
        "next_run": own + 1,
        "node_id": settings.node_id,
        "source_file": str(Path(__file__).resolve().parents[1] / "torchyard" / "streams.py"),
        "other_runs_temp": temp_owner.files,
    }
    spec = script_spec("attacker", bundle.json()["id"], "attack.py", [json.dumps(targets)])
    attacker = attacker_api.post("/api/v1/runs", json=spec).raise_for_status().json()
    assert attacker["id"] == own, f"another run took id {own}: the attacker's targets are off"

    def attacks_done() -> bool:
        logs = attacker_api.get(f"/api/v1/runs/{attacker['id']}/logs", params={"rank": 0, "limit": 10_000}).json()
        if any("attacks done" in line["text"] for line in logs):
            return True
        # it ended without finishing its attacks: the results say which are missing
        return attacker_api.get(f"/api/v1/runs/{attacker['id']}").json()["status"] in TERMINAL

    wait_for(attacks_done, max(10.0, deadline - time.monotonic()), "the attacker's script", interval=0.3)
    # The victim must still have been training while every attack ran, or the attacks proved nothing.
    victim_while_attacked = victim_api.get(f"/api/v1/runs/{victim['id']}").json()["status"]
    temp_owner.release(settings)
    out.attacker = _wait_terminal(attacker_api, attacker["id"], max(10.0, deadline - time.monotonic()))
    out.victim = _wait_terminal(victim_api, victim["id"], max(10.0, deadline - time.monotonic()))
    out.victim_rows = count_rows(victim["id"])
    out.temp_owner = _wait_terminal(victim_api, temp_owner.run["id"], max(10.0, deadline - time.monotonic()))
    out.worker_alive = psutil.pid_exists(worker_pid) and psutil.Process(worker_pid).status() != psutil.STATUS_ZOMBIE

    logs = attacker_api.get(f"/api/v1/runs/{attacker['id']}/logs", params={"limit": 10_000}).json()
    reported = {}
    for line in logs:
        text = line["text"]
        if RESULT_PREFIX in text:
            item = json.loads(text.split(RESULT_PREFIX, 1)[1])
            reported[item["attack"]] = item
    own_rows = count_rows(attacker["id"], any_key=True)
    for name, item in reported.items():
        if name in ALLOWED_BY_DESIGN:
            if "report" in name:
                held = out.attacker["status"] == "succeeded"
                detail = f"written ({item['detail']}); the attacker's run ended {out.attacker['status']}"
            else:
                held = not any(rank == 99 for rank, _ in own_rows)
                detail = f"written; ingest stored {len(own_rows)} of its points (rank 99 / attempt 7: none)"
        else:
            held = item["outcome"] == "refused"
            detail = item["detail"]
        if name == "kill another run's ranks":
            held = held and out.victim["status"] == "succeeded"
        if name.startswith("read another run's file in"):
            held = held and out.temp_owner["status"] == "succeeded"
        if name == "Celery broadcast('shutdown')":
            held = held and out.worker_alive
            detail += f"; worker {'still up' if out.worker_alive else 'GONE'}"
        out.results.append(Outcome(name, held, detail))
    victim_ok = out.victim["status"] == "succeeded" and victim_while_attacked not in TERMINAL
    exact = _exactly_once(out.victim_rows, 2, victim_steps)
    out.results.append(
        Outcome(
            "victim run unaffected",
            victim_ok and exact,
            f"{out.victim['status']} (was {victim_while_attacked} when the attacks were done; ran "
            f"{out.victim['started_at']}..{out.victim['ended_at']}, attacker {out.attacker['started_at']}.."
            f"{out.attacker['ended_at']}); 'loss' rows "
            f"{sum(out.victim_rows.values())} for {2 * victim_steps} rank-steps, each once: {exact}",
        )
    )
    out.results.append(temp_owner.outcome(out.temp_owner))
    out.temp_sizes = temp_owner.sizes
    if not reported:
        out.results.append(Outcome("attacker script ran", False, f"no results in its log: {logs[-5:]}"))
    return out


@dataclass
class TempOwner:
    """Run A of the temp-space attacks (:data:`TEMP_OWNER_SCRIPT`): the secret it leaves in each
    temp place, the sizes of its /tmp and /dev/shm, and its log."""

    api: httpx.Client
    run: dict[str, Any]
    files: dict[str, str]  # temp place -> its secret file there
    sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, api: httpx.Client, tag: str) -> TempOwner:
        files = {place: f"{place}/torchyard-secret-{tag}" for place in TEMP_PLACES}
        secrets = {path: f"run A's secret {tag}" for path in files.values()}
        bundle = api.post("/api/v1/bundles", files={"file": ("temp.zip", bundle_bytes("temp.py", TEMP_OWNER_SCRIPT))})
        args = [json.dumps(secrets), str(TEMP_HOLD_S)]
        run = api.post(
            "/api/v1/runs", json=script_spec("temp-owner", bundle.raise_for_status().json()["id"], "temp.py", args)
        )
        return cls(api, run.raise_for_status().json(), files)

    def _log(self) -> list[str]:
        lines = self.api.get(f"/api/v1/runs/{self.run['id']}/logs", params={"limit": 10_000}).raise_for_status().json()
        return [line["text"] for line in lines]

    def wait_planted(self, timeout: float) -> None:
        def planted() -> bool:
            found = [t.split(TEMP_PREFIX, 1)[1] for t in self._log() if TEMP_PREFIX in t]
            if found:
                self.sizes = json.loads(found[0])
            elif self.api.get(f"/api/v1/runs/{self.run['id']}").json()["status"] in TERMINAL:
                raise AssertionError(f"run A ended before planting its files: {self._log()[-10:]}")
            return bool(found)

        wait_for(planted, timeout, "run A to leave its temp files", interval=0.3)

    def release(self, settings: Settings) -> None:
        """Lets run A end: a file in its cwd (its code folder), put there as the platform can."""
        (rundirs.run_dir(settings, self.run["id"], 1) / "code" / "release").touch()

    def outcome(self, ended: dict[str, Any]) -> Outcome:
        intact = "temp files intact" in self._log()
        sizes = ", ".join(f"{place} {size / 2**30:.1f} GiB" for place, size in self.sizes.items())
        return Outcome(
            "run A's temp files unaffected",
            ended["status"] == "succeeded" and intact,
            f"{ended['status']}; its files intact: {intact}; DataLoader workers ran; it saw {sizes}",
        )


def _exactly_once(rows: dict[tuple[int, int], int], world: int, steps: int) -> bool:
    expected = {(rank, step) for rank in range(world) for step in range(1, steps + 1)}
    return set(rows) == expected and all(n == 1 for n in rows.values())


def _is_rank(pid: int) -> bool:
    try:
        return "workers.runtime.train" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def row_counter(database_url: str) -> Any:
    """``count_rows`` for :func:`run_scenario` on any SQLAlchemy URL."""
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)

    def count(run_id: int, any_key: bool = False) -> dict[tuple[int, int], int]:
        where = "" if any_key else " AND key = 'loss'"
        with engine.connect() as conn:
            rows = conn.execute(
                text(f"SELECT rank, step, count(*) FROM metrics WHERE run_id = :r{where} GROUP BY rank, step"),
                {"r": run_id},
            )
            return {(int(r), int(s)): int(n) for r, s, n in rows}

    return count


def table(results: list[Outcome], width: int = 110) -> str:
    detail_width = width
    width = max(len(r.attack) for r in results)
    lines = [f"{'attack':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    for r in results:
        lines.append(f"{r.attack:<{width}}  {'held' if r.held else 'BROKEN':<6}  {r.detail[:detail_width]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--victim-steps", type=int, default=VICTIM_STEPS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ty-attacks-") as tmp, sqlite_stack(Path(tmp)) as stack:
        assert stack.redis is not None
        scenario = run_scenario(
            stack.settings,
            stack.token,
            Path(stack.settings.sqlalchemy_url.removeprefix("sqlite:///")),
            stack.redis.data_dir / "platform-password",
            [p.pid for p in stack.stack.procs.values()],
            stack.stack.procs["worker"].pid,
            row_counter(stack.settings.sqlalchemy_url),
            victim_steps=args.victim_steps,
        )
    if os.geteuid() != 0:
        print("note: not root: ranks are not isolated, so the file, /proc and signal attacks are expected to break")
    results = [*scenario.results, *planted_and_capped()]
    print(table(results))
    return 0 if all(r.held for r in results) else 1


# The second round's attacks (README "Walls"): what a run plants in the files the platform reads
# (a link swapped in during checkpoint downloads, huge, FIFO and linked error files), what it makes
# Redis hold, and what it takes of a node (a fork bomb, a disk filler, a memory hog). Each is a test
# under tests/security; here they run as they do there, one row each.
SECOND_ROUND = (
    "tests/security/test_planted_files.py",
    "tests/security/test_redis_memory.py",
    "tests/security/test_caps.py",
    "tests/security/test_run_caps.py",
)


def planted_and_capped() -> list[Outcome]:
    import pytest

    class Collect:
        def __init__(self) -> None:
            self.results: list[Outcome] = []

        def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
            if report.when == "call" or report.failed:  # a setup that failed is a wall not shown to hold
                name = report.nodeid.split("::", 1)[1].removeprefix("test_").replace("_", " ")
                detail = "" if report.passed else report.longreprtext.strip().splitlines()[-1][:200]
                self.results.append(Outcome(name, report.passed or report.skipped, detail or report.outcome))

    root = Path(__file__).resolve().parent.parent
    collect = Collect()
    pytest.main(["-q", "-p", "no:cacheprovider", *(str(root / t) for t in SECOND_ROUND)], plugins=[collect])
    return collect.results


if __name__ == "__main__":
    sys.exit(main())
