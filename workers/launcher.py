"""Launching one node's share of an attempt as a torchrun process tree in its own session and
supervising it to its end (the Celery task in ``tasks.py`` claims it and reports the outcome), and
ending the trees a dead worker left behind. Its parts, one concept each: ``torchrun.py`` (env,
command line, the gang), ``credentials.py`` (the attempt's Redis user), ``output.py`` (log batches,
reports), ``cancel.py`` (when to stop), ``rundirs.py`` (the node's disk), ``isolation.py`` (the run
user and namespaces), ``proctree.py`` (ending a whole tree).

Why a subprocess and its own session (docs/architecture.md; measured here): Celery's
revoke kills only the pool child, leaving torchrun training; ``elastic_launch`` cannot start
inside a prefork child. A process group we own can be ended whole with ``killpg``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import subprocess
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import redis

from torchyard import hangdump, stores
from torchyard.runfiles import disk_usage
from torchyard.settings import Settings
from torchyard.spec import RunSpec
from torchyard.states import AttemptState
from workers import caps, code, failure, isolation, proctree, rundirs
from workers.cancel import attempt_ended, cancel_requested, mark_cancel
from workers.credentials import close_rank_credential, open_rank_credential
from workers.diagnose import DiagnoseWatch
from workers.output import LogPump, report
from workers.rundirs import attempts_dir, remove_run_dir, stopping_marker
from workers.torchrun import (
    PROJECT_ROOT,
    TORCHRUN_LOGS,
    Gang,
    dataset_access,
    is_script,
    join_gang,
    torchrun_command,
    training_env,
)

log = logging.getLogger(__name__)
DISK_CHECK_S = 2.0  # how often a run's disk use is measured against TORCHYARD_RUN_MAX_DISK_BYTES


@dataclass
class Outcome:
    status: AttemptState  # SUCCEEDED | FAILED | CANCELLED
    returncode: int | None
    reason: str
    retryable: bool = False  # the node failed, not the run: another attempt may succeed


def run_and_report(
    client: redis.Redis,
    settings: Settings,
    run_id: int,
    attempt: int,
    spec: dict,
    bundle_capability: str | None,
    node_rank: int,
    nnodes: int,
    rdzv_host: str,
    cancel_token: str | None,
    gpus: list[int] | None = None,
) -> Outcome:
    """A claimed share from its start to its exit report: the same on a Celery worker (``tasks.py``)
    and in a Slurm job step (``slurm_step.py``). Joins the gang (node rank 0 opens the c10d
    rendezvous on its own address), launches, supervises, and reports how it ended."""
    if cancel_requested(client, run_id, cancel_token):
        outcome = Outcome(AttemptState.CANCELLED, None, "cancelled before it started")
    elif attempt_ended(client, run_id, attempt):  # e.g. the cancel was completed without it
        outcome = Outcome(AttemptState.FAILED, None, "the attempt ended before it started")
    else:
        try:
            gang = join_gang(client, settings, run_id, attempt, node_rank, nnodes, rdzv_host, cancel_token)
            if gang is None:
                outcome = Outcome(AttemptState.CANCELLED, None, "cancelled or ended while waiting for the gang")
            else:
                outcome = launch_share(
                    client, settings, run_id, attempt, spec, bundle_capability, gang, cancel_token, gpus
                )
        except Exception:
            log.exception("launching run %s attempt %s failed", run_id, attempt)
            outcome = Outcome(
                AttemptState.FAILED, None, "the worker could not launch the run:\n" + traceback.format_exc()
            )
    report(client, run_id, attempt, settings.node_id, "exited", status=outcome.status,
           returncode=outcome.returncode, reason=outcome.reason, retryable=outcome.retryable)  # fmt: skip
    return outcome


def launch_share(
    client: redis.Redis,
    settings: Settings,
    run_id: int,
    attempt: int,
    spec: dict,
    bundle_capability: str | None = None,
    gang: Gang | None = None,
    cancel_token: str | None = None,
    gpus: list[int] | None = None,
) -> Outcome:
    """Runs the node's share of an attempt to its end; returns how it ended. Blocks. However it
    ends (launch failed, crashed, cancelled, succeeded) its run directory and its Redis user go
    with it."""
    gang = gang or Gang(local_addr=settings.node_host)
    run_dir = rundirs.run_dir(settings, run_id, attempt)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        rank_url = open_rank_credential(client, settings, run_id, attempt, gang.node_rank)
        try:
            access = dataset_access(settings, spec, run_dir)
            folder = access.folder if access else None
            env = training_env(settings, run_id, attempt, spec, run_dir, rank_url, gpus, folder)
            return _run_share(
                client, settings, run_id, attempt, spec, bundle_capability, gang, cancel_token, run_dir, env, access
            )
        finally:
            close_rank_credential(client, run_id, attempt, gang.node_rank)
    finally:
        remove_run_dir(settings, run_id, attempt)


def _run_share(
    client: redis.Redis,
    settings: Settings,
    run_id: int,
    attempt: int,
    spec: dict,
    bundle_capability: str | None,
    gang: Gang,
    cancel_token: str | None,
    run_dir: Path,
    env: dict[str, str],
    access: stores.Access | None,
) -> Outcome:
    checkpoints = settings.checkpoints / str(run_id)
    checkpoints.mkdir(parents=True, exist_ok=True)
    cwd = code.prepare(settings, spec["workload"], bundle_capability, run_dir) if is_script(spec) else run_dir
    command = torchrun_command(spec, run_dir, run_id, attempt, gang)
    stash: Path | None = None
    group: caps.RunGroup | None = None
    if isolation.isolating():
        user = isolation.ensure_run_user(settings.run_user)
        isolation.give(run_dir, user)
        platform_group = settings.state_dir.stat().st_gid  # the api's (docker-compose: the image's user's)
        isolation.open_to_group(settings.checkpoints, platform_group)
        isolation.give(checkpoints, user, platform_group)
        stash = Path(tempfile.mkdtemp(prefix="torchyard-mounts-"))  # where the run's /tmp is made (isolation.py)
        needed = [*isolation.interpreter_paths(), PROJECT_ROOT, run_dir, checkpoints]
        temp = isolation.TempSpace(settings.run_tmp_bytes, settings.run_shm_bytes)
        readonly = access.readonly if access else ()
        command = isolation.wrap(command, user, needed, stash, temp, readonly=readonly)
        group = caps.RunGroup.create(run_id, attempt, run_caps(settings, spec))
        if group is not None:
            command = group.enter(command)
    try:
        outcome = _supervise(
            client, settings, run_id, attempt, spec, gang, cancel_token, run_dir, cwd, command, env, stash, group
        )
        hit = group.breaches() if group is not None else []
        if hit and outcome.status == AttemptState.FAILED:  # said first: the run's own error follows from it
            outcome = dataclasses.replace(outcome, reason="\n".join([*hit, outcome.reason]), retryable=False)
        return outcome
    finally:
        if group is not None:
            group.remove()
        if stash is not None:
            shutil.rmtree(stash, ignore_errors=True)


def run_caps(settings: Settings, spec: dict) -> caps.Caps:
    """The node's caps, the memory one lowered to the run's own ``resources.memory_limit_bytes``."""
    asked = RunSpec.model_validate(spec).resources.memory_limit_bytes
    limits = [m for m in (asked, settings.run_max_memory_bytes) if m]
    return caps.Caps(pids=settings.run_max_pids, memory_bytes=min(limits, default=0))


def _supervise(
    client: redis.Redis,
    settings: Settings,
    run_id: int,
    attempt: int,
    spec: dict,
    gang: Gang,
    cancel_token: str | None,
    run_dir: Path,
    cwd: Path,
    command: list[str],
    env: dict[str, str],
    stash: Path | None,
    group: caps.RunGroup | None = None,
) -> Outcome:
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: killpg ends torchrun and every rank
    )
    record = attempts_dir(settings) / f"{run_id}-{attempt}.json"
    grace = RunSpec.model_validate(spec).training.cancel_grace(settings.cancel_grace_s)
    # The mount stash is recorded too: a worker killed with -9 leaves it, its successor removes it.
    # The run dir and grace let a stopping worker end the group as a cancel (ranks may save first).
    info = {
        "run_id": run_id,
        "attempt": attempt,
        "node_rank": gang.node_rank,
        "pgid": proc.pid,
        "stash": str(stash or ""),
        "run_dir": str(run_dir),
        "grace": grace,
        "cgroups": [str(d) for d in group.dirs.values()] if group else [],
    }
    record.write_text(json.dumps(info))
    pump = LogPump(client, run_id, attempt, proc.stdout, settings.max_log_line_bytes)  # type: ignore[arg-type]
    diagnose = DiagnoseWatch(client, run_id, attempt, settings.node_id, run_dir, spec["resources"]["procs_per_node"])
    report(client, run_id, attempt, settings.node_id, "started", pid=proc.pid)
    cancelled = ended_elsewhere = False
    disk = DiskWatch(settings.run_max_disk_bytes, [run_dir, settings.checkpoints / str(run_id)])
    try:
        while proc.poll() is None:
            if not (cancelled or ended_elsewhere or disk.over):
                diagnose.poll()  # before the end key: a stalled attempt is diagnosed, then ended
                cancelled = cancel_requested(client, run_id, cancel_token)
                ended_elsewhere = not cancelled and attempt_ended(client, run_id, attempt)
                if cancelled:  # the ranks read the marker: a cancel, not torch elastic ending a crashed gang
                    mark_cancel(run_dir, "cancelled")
                if cancelled or ended_elsewhere or disk.check():
                    proctree.end_process_group(proc.pid, grace if cancelled else settings.cancel_grace_s)
            time.sleep(0.2)
        # Ranks may have left children of their own (data loaders): the group goes with the run.
        proctree.end_process_group(proc.pid, 0.5)
    finally:
        diagnose.join(timeout=hangdump.RANK_ANSWER_S + 1)  # its dumps go out before the exit report
        pump.join(timeout=10)
        record.unlink(missing_ok=True)
    if disk.over:
        return Outcome(AttemptState.FAILED, proc.returncode, disk.reason())
    if ended_elsewhere:
        return Outcome(
            AttemptState.FAILED,
            proc.returncode,
            "the attempt ended elsewhere (another node of its gang, or the watchdog)",
        )
    if not cancelled and stopping_marker(settings).exists():
        reason = f"worker {settings.node_id} shut down while the run was training"
        return Outcome(AttemptState.FAILED, proc.returncode, reason, retryable=True)
    if cancelled:
        return Outcome(AttemptState.CANCELLED, proc.returncode, "every process of the run was ended on cancel")
    if proc.returncode == 0:
        return Outcome(AttemptState.SUCCEEDED, 0, "")
    roots = [run_dir / "code"] if is_script(spec) else [PROJECT_ROOT]  # where the run's own code lives
    why = failure.describe(
        proc.returncode, run_dir / TORCHRUN_LOGS, roots, pump.rank_traceback, list(pump.agent_tail), list(pump.tail)
    )
    return Outcome(AttemptState.FAILED, proc.returncode, why)


class DiskWatch:
    """The run's disk cap, a watched bound (no quota on a shared directory): the run directory and
    the run's checkpoints measured every ``every_s`` seconds of the supervising loop."""

    def __init__(self, cap: int, paths: list[Path], every_s: float = DISK_CHECK_S) -> None:
        self.cap, self.paths, self.every_s = cap, paths, every_s
        self.used, self.over, self._next = 0, False, 0.0

    def check(self) -> bool:
        """True once the run's files are past the cap (it stays so)."""
        now = time.monotonic()
        if not self.over and now >= self._next:
            self._next = now + self.every_s
            self.used = disk_usage(self.paths, self.cap)
            self.over = self.used > self.cap
        return self.over

    def reason(self) -> str:
        return (
            f"the run's files passed its disk cap: {self.used / 2**20:,.0f} MiB in its run directory and checkpoints, "
            f"above {self.cap / 2**20:,.0f} MiB (TORCHYARD_RUN_MAX_DISK_BYTES); its processes were ended"
        )


def end_recorded_attempts(settings: Settings) -> None:
    """Ends every process group this node's worker recorded and that still runs a run, all at once.
    A stopping worker ends them as a cancel (marker, then SIGTERM, with the run's cancel grace):
    ranks that save on cancel save at the step boundary first, and the next attempt resumes there."""
    records = [json.loads(record.read_text()) for record in attempts_dir(settings).glob("*.json")]
    live = [info for info in records if proctree.is_run_process(info["pgid"], info["run_id"])]
    for info in live:
        # A record of an older worker (no run_dir), or a run dir already gone: a plain SIGTERM.
        with contextlib.suppress(KeyError, OSError):
            mark_cancel(Path(info["run_dir"]), "the worker is stopping")
    ending = [
        threading.Thread(
            target=proctree.end_process_group, args=(info["pgid"], info.get("grace", settings.cancel_grace_s))
        )
        for info in live
    ]
    for thread in ending:
        thread.start()
    for thread in ending:
        thread.join()
    for info in records:
        if info.get("stash"):  # its processes are gone: nothing mounts there any more
            shutil.rmtree(info["stash"], ignore_errors=True)


def stop_grace_s(settings: Settings) -> float:
    """How long ending this node's recorded attempts may take: the longest cancel grace among them
    (a run that saves on cancel gets minutes for its save)."""
    graces = [settings.cancel_grace_s]
    for record in attempts_dir(settings).glob("*.json"):
        try:
            graces.append(float(json.loads(record.read_text()).get("grace", 0)))
        except (OSError, ValueError):
            continue
    return max(graces)


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
            status=AttemptState.FAILED,
            returncode=None,
            reason=f"worker {settings.node_id} restarted; the attempt's processes were ended",
            retryable=True,
        )
        close_rank_credential(client, info["run_id"], info["attempt"], info.get("node_rank", 0))
        caps.remove_groups([Path(d) for d in info.get("cgroups", [])])  # what escaped the process group too
        if info.get("stash"):
            shutil.rmtree(info["stash"], ignore_errors=True)
        record.unlink(missing_ok=True)
    return ended
