"""Launching one node's share of an attempt as a torchrun process tree in its own session,
capturing every rank's output, obeying cancels, and ending orphans a dead worker left behind.

Why a subprocess and its own session (see ARCHITECTURE.md "Measured on this machine"): Celery's
revoke kills only the pool child, leaving torchrun training; ``elastic_launch`` cannot start
inside a prefork child. A process group we own can be ended whole with ``killpg``."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import redis

from torchyard import streams
from torchyard.procs import free_port
from torchyard.settings import Settings
from workers import code, proctree

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RANK_PREFIX = re.compile(r"^\[torchyard-rank (\d+)\]:(.*)$")
# Variables a training process may inherit; nothing else of the worker's environment (no secrets).
PASSED_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "TZ",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
)
LOG_FLUSH_S = 0.25
TAIL_LINES = 60


@dataclass
class Outcome:
    status: str  # succeeded | failed | cancelled
    returncode: int | None
    reason: str
    retryable: bool = False  # the node failed, not the run: another attempt may succeed


def stopping_marker(settings: Settings) -> Path:
    """Present while this node's worker is shutting down: a run it ends then says so."""
    return attempts_dir(settings).parent / "stopping"


def attempts_dir(settings: Settings) -> Path:
    """Where a worker records the process groups it started, so a restarted worker finds them."""
    path = settings.state_dir / "workers" / settings.node_id / "attempts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_script(spec: dict) -> bool:
    return bool(spec.get("workload", {}).get("kind") == "script")


def training_env(settings: Settings, run_id: int, attempt: int, spec: dict, run_dir: Path) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    if is_script(spec):  # the instrumentation's sitecustomize first: unmodified scripts are measured too
        env.update(PYTHONPATH=os.pathsep.join((str(code.INJECT_DIR), str(PROJECT_ROOT))), TORCHYARD_INSTRUMENT="1")
    else:
        env.update(PYTHONPATH=str(PROJECT_ROOT))
    env.update(
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[torchyard-rank ${rank}]:",
        # With the agent's rendezvous store shared (torch's default), ranks restarted by
        # --max-restarts read their peers' addresses from the round before and fail to connect
        # (pytorch/pytorch#135712, seen here on Gloo): each round gets a store of its own.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        TORCHYARD_REDIS_URL=settings.redis_url,
        TORCHYARD_RUN_ID=str(run_id),
        TORCHYARD_ATTEMPT=str(attempt),
        TORCHYARD_SPEC=json.dumps(spec),
        TORCHYARD_RUN_DIR=str(run_dir),
        TORCHYARD_CHECKPOINT_DIR=str(settings.checkpoints / str(run_id)),  # shared by the run's attempts
    )
    training = spec.get("training", {})
    if training.get("checkpoint_on_cancel") or training.get("cancel_grace_s") is not None:
        # torchrun SIGKILLs its ranks this long after passing our SIGTERM on (default 30 s): give them the run's
        # grace, less a second for torchrun to end them itself before we SIGKILL what remains
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(max(0, math.floor(cancel_grace_s(settings, spec)) - 1))
        env["TORCHYARD_CANCEL_MARKER"] = str(run_dir / CANCEL_MARKER)  # present: a SIGTERM is a cancel
    return env


@dataclass(frozen=True)
class Gang:
    """This node's place in a multi-node attempt."""

    node_rank: int = 0
    nnodes: int = 1
    rdzv_endpoint: str = ""  # host:port of the c10d store on node rank 0
    local_addr: str = "127.0.0.1"  # this node's advertised address


RDZV_JOIN_TIMEOUT_S = 300


def torchrun_command(spec: dict, run_dir: Path, run_id: int, attempt: int, gang: Gang) -> list[str]:
    res, training = spec["resources"], spec.get("training", {})
    if is_script(spec):  # as `torchrun ... train.py args` runs it, from the unpacked bundle (the cwd)
        target = [str(run_dir / "code" / spec["workload"]["entry"]), *spec["workload"].get("args", [])]
    else:
        target = ["-m", "workers.runtime.train"]
    if gang.nnodes == 1:
        rendezvous = ["--standalone", "--nnodes", "1"]
    else:  # node rank 0 hosts the store on its own address; the others join it
        rendezvous = [
            "--nnodes",
            str(gang.nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            gang.rdzv_endpoint,
            "--rdzv-id",
            f"run-{run_id}-attempt-{attempt}",
            "--rdzv-conf",
            f"is_host={str(gang.node_rank == 0).lower()},join_timeout={RDZV_JOIN_TIMEOUT_S}",
            "--local-addr",
            gang.local_addr,
        ]
    return [
        sys.executable, "-m", "torch.distributed.run", *rendezvous,
        "--nproc-per-node", str(res["procs_per_node"]),
        "--max-restarts", str(training.get("max_restarts", 0)),
        "--tee", "3", "--log-dir", str(run_dir / "torchrun-logs"),
        *target,
    ]  # fmt: skip


def join_gang(
    client: redis.Redis, settings: Settings, run_id: int, attempt: int, node_rank: int, nnodes: int, rdzv_host: str
) -> Gang | None:
    """Node rank 0 picks a free port on its own address and publishes the endpoint; the others
    wait for it. None: the run was cancelled or the attempt ended while waiting."""
    if nnodes == 1:
        return Gang(local_addr=settings.node_host)
    key = streams.rendezvous_key(run_id, attempt)
    if node_rank == 0:
        endpoint = f"{settings.node_host}:{free_port(settings.node_host)}"
        client.set(key, endpoint, ex=7 * 86400)
        return Gang(0, nnodes, endpoint, settings.node_host)
    deadline = time.monotonic() + RDZV_JOIN_TIMEOUT_S
    while time.monotonic() < deadline:
        if _should_stop(client, run_id, attempt):
            return None
        published: Any = client.get(key)
        if published:
            return Gang(node_rank, nnodes, published.decode(), settings.node_host)
        time.sleep(0.2)
    raise TimeoutError(f"node rank 0 ({rdzv_host}) did not open the rendezvous within {RDZV_JOIN_TIMEOUT_S}s")


class _LogPump:
    """Reads the launcher's combined output and XADDs it in batches, one entry per ~250 ms."""

    def __init__(self, client: redis.Redis, run_id: int, attempt: int, pipe: IO[bytes]) -> None:
        self.client, self.stream, self.attempt, self.pipe = client, streams.run_stream(run_id), attempt, pipe
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.rank_traceback: list[str] = []  # the first traceback a rank printed: the root cause
        self._traceback_rank: int | None = None
        self.thread = threading.Thread(target=self._pump, name=f"logs-{run_id}", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        batch: list[list[object]] = []
        last_flush = time.monotonic()
        for raw in iter(self.pipe.readline, b""):
            text = raw.decode(errors="replace").rstrip("\n")
            match = RANK_PREFIX.match(text)
            rank, text = (int(match.group(1)), match.group(2)) if match else (-1, text)
            self.tail.append(text)
            self._note_traceback(rank, text)
            batch.append([rank, time.time(), text])
            if time.monotonic() - last_flush >= LOG_FLUSH_S or len(batch) >= 500:
                self._send(batch)
                batch, last_flush = [], time.monotonic()
        self._send(batch)

    def _note_traceback(self, rank: int, text: str) -> None:
        if rank < 0 or len(self.rank_traceback) >= TAIL_LINES:
            return
        if self._traceback_rank is None and text.lstrip().startswith("Traceback (most recent call last)"):
            self._traceback_rank = rank
        if self._traceback_rank == rank:
            self.rank_traceback.append(text)

    def _send(self, lines: list[list[object]]) -> None:
        if not lines:
            return
        entry = streams.encode(streams.LOGS, {"attempt": self.attempt, "lines": lines})
        for delay in (0.1, 0.5, 1, 2, 4, 8):  # Redis may be restarting; the lines wait for it
            try:
                self.client.xadd(self.stream, entry)
                return
            except redis.RedisError:
                time.sleep(delay)
        log.error("dropped %d log lines of %s: Redis unreachable", len(lines), self.stream)

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


def report(client: redis.Redis, run_id: int, attempt: int, node_id: str, event: str, **fields: object) -> None:
    data = {"attempt": attempt, "node": node_id, "event": event, **fields}
    for delay in (0.1, 0.5, 1, 2, 4, 8, 16):
        try:
            client.xadd(streams.run_stream(run_id), streams.encode(streams.REPORT, data))
            return
        except redis.RedisError:
            time.sleep(delay)
    raise RuntimeError(f"could not report {event} of run {run_id} attempt {attempt}: Redis unreachable")


CANCEL_MARKER = "cancel-requested"  # in TORCHYARD_RUN_DIR, written before the SIGTERM of a cancel
CHECKPOINT_ON_CANCEL_GRACE_S = 120.0  # the least grace with training.checkpoint_on_cancel: the save must fit


def cancel_grace_s(settings: Settings, spec: dict) -> float:
    """SIGTERM → SIGKILL grace on cancel: training.cancel_grace_s, else TORCHYARD_CANCEL_GRACE_S (at least
    CHECKPOINT_ON_CANCEL_GRACE_S when the ranks save on cancel). The group is gone as soon as they exit."""
    training = spec.get("training", {})
    if training.get("cancel_grace_s") is not None:
        return float(training["cancel_grace_s"])
    if training.get("checkpoint_on_cancel"):
        return max(settings.cancel_grace_s, CHECKPOINT_ON_CANCEL_GRACE_S)
    return settings.cancel_grace_s


def run_attempt(
    client: redis.Redis,
    settings: Settings,
    run_id: int,
    attempt: int,
    spec: dict,
    bundle_capability: str | None = None,
    gang: Gang | None = None,
) -> Outcome:
    """Runs the node's share of an attempt to its end; returns how it ended. Blocks."""
    gang = gang or Gang(local_addr=settings.node_host)
    run_dir = settings.state_dir / "runs" / str(run_id) / f"attempt-{attempt}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cwd = code.prepare(settings, spec["workload"], bundle_capability, run_dir) if is_script(spec) else run_dir
    proc = subprocess.Popen(
        torchrun_command(spec, run_dir, run_id, attempt, gang),
        env=training_env(settings, run_id, attempt, spec, run_dir),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: killpg ends torchrun and every rank
    )
    record = attempts_dir(settings) / f"{run_id}-{attempt}.json"
    record.write_text(json.dumps({"run_id": run_id, "attempt": attempt, "pgid": proc.pid}))
    pump = _LogPump(client, run_id, attempt, proc.stdout)  # type: ignore[arg-type]
    report(client, run_id, attempt, settings.node_id, "started", pid=proc.pid)
    cancelled = ended_elsewhere = False
    try:
        while proc.poll() is None:
            if not (cancelled or ended_elsewhere):
                cancelled = _cancel_requested(client, run_id)
                ended_elsewhere = not cancelled and _attempt_ended(client, run_id, attempt)
                if cancelled:  # the ranks read the marker: a cancel, not torch elastic ending a crashed gang
                    (run_dir / CANCEL_MARKER).touch()
                if cancelled or ended_elsewhere:
                    proctree.end_process_group(
                        proc.pid, cancel_grace_s(settings, spec) if cancelled else settings.cancel_grace_s
                    )
            time.sleep(0.2)
        # Ranks may have left children of their own (data loaders): the group goes with the run.
        proctree.end_process_group(proc.pid, 0.5)
    finally:
        pump.join(timeout=10)
        record.unlink(missing_ok=True)
    if ended_elsewhere:
        return Outcome(
            "failed", proc.returncode, "the attempt ended elsewhere (another node of its gang, or the watchdog)"
        )
    if not cancelled and stopping_marker(settings).exists():
        reason = f"worker {settings.node_id} shut down while the run was training"
        return Outcome("failed", proc.returncode, reason, retryable=True)
    # A script without torch's @record leaves the agent's summary without the error: take the rank's own.
    tail = pump.rank_traceback if is_script(spec) and pump.rank_traceback else list(pump.tail)
    return _outcome(proc.returncode, cancelled, tail)


def _cancel_requested(client: redis.Redis, run_id: int) -> bool:
    return _flag(client, streams.cancel_key(run_id))


def _attempt_ended(client: redis.Redis, run_id: int, attempt: int) -> bool:
    return _flag(client, streams.attempt_end_key(run_id, attempt))


def _should_stop(client: redis.Redis, run_id: int, attempt: int) -> bool:
    return _cancel_requested(client, run_id) or _attempt_ended(client, run_id, attempt)


def _flag(client: redis.Redis, key: str) -> bool:
    try:
        return bool(client.exists(key))
    except redis.RedisError:
        return False  # Redis briefly away: keep training, ask again next tick


def _outcome(returncode: int, cancelled: bool, tail: list[str]) -> Outcome:
    if cancelled:
        return Outcome("cancelled", returncode, "every process of the run was ended on cancel")
    if returncode == 0:
        return Outcome("succeeded", 0, "")
    how = f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"
    return Outcome("failed", returncode, f"training exited with {how}\n" + _traceback_tail(tail))


def _traceback_tail(tail: list[str]) -> str:
    """The last traceback the ranks printed (the part a user needs), else the last lines."""
    for i in range(len(tail) - 1, -1, -1):
        if tail[i].lstrip().startswith("Traceback (most recent call last)"):
            return "\n".join(tail[i:])
    return "\n".join(tail[-20:])


def end_recorded_attempts(settings: Settings) -> None:
    """Ends every process group this node's worker recorded and that still runs a run."""
    for record in attempts_dir(settings).glob("*.json"):
        info = json.loads(record.read_text())
        if proctree.is_run_process(info["pgid"], info["run_id"]):
            proctree.end_process_group(info["pgid"], settings.cancel_grace_s)


def end_orphans(client: redis.Redis, settings: Settings) -> int:
    """A worker killed with -9 leaves its torchrun trees running: end them and report them."""
    ended = 0
    for record in attempts_dir(settings).glob("*.json"):
        info = json.loads(record.read_text())
        if proctree.is_run_process(info["pgid"], info["run_id"]):
            log.warning(
                "ending orphaned run %s attempt %s (process group %s)", info["run_id"], info["attempt"], info["pgid"]
            )
            proctree.end_process_group(info["pgid"], settings.cancel_grace_s)
            ended += 1
        report(
            client,
            info["run_id"],
            info["attempt"],
            settings.node_id,
            "exited",
            status="failed",
            returncode=None,
            reason=f"worker {settings.node_id} restarted; the attempt's processes were ended",
            retryable=True,
        )
        record.unlink(missing_ok=True)
    return ended
