"""Slurm pools: runs handed to an existing Slurm cluster, which gang-schedules them itself.

The client is Slurm's own commands (``sbatch``, ``scontrol``, ``scancel``, ``sinfo``) run as
subprocesses. Why: they come with every Slurm install (Debian's slurm-client), speak the cluster's
own auth (munge) and version, and need nothing else on the service host but the cluster's
slurm.conf and munge key. ``slurmrestd`` is a daemon more to run and secure (JWT), which many
clusters do not run; submitit submits pickled Python callables (its own job format) and polls
through ``sacct``, which needs slurmdbd. Accounting (``sacct``) is not used: a finished job's
state is read with ``scontrol show job`` while slurmctld keeps it (MinJobAge, 300 s by default).

One attempt = one batch job: ``--nodes`` N, ``--ntasks-per-node=1``, ``--cpus-per-task`` (the
run's processes per node), ``--gpus-per-node`` (a CUDA run), ``--time`` from
``training.max_duration_s``, the pool's partition and account, ``--requeue``, job name
``torchyard-run-<id>``. Its script runs one node agent per node through ``srun``
(``workers/slurm_step.py``): the same share runtime as a Celery worker (the attempt's own Redis
user for the ranks, torchrun with a c10d rendezvous on node rank 0, the log pump, the cancel key,
the started/exited reports), so live metrics, logs and state reach the run's streams exactly as
from our workers. Logs: pumped by the agent in the job step, not files tailed by the service: live,
through the same platform stream, and with no shared log directory to poll.

The scheduler's leader polls each live job (``scontrol show job``) every pass: Slurm's pending
reason becomes the run's ``status_reason``; a job that ends settles its attempt when no agent's
report did (COMPLETED is the only way a Slurm attempt succeeds: every node's step exited 0);
NODE_FAIL or PREEMPTED is the node's failure, not the run's (a new attempt, bounded by
``max_attempts``: the same job when Slurm requeued it, else a new one); a job Slurm requeued
runs the next attempt. Cancel: a pending job is scancelled at once; a running one is ended by its
agents on the run's cancel key with the run's grace, then scancelled if it is still there."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import redis
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from backend import attempts, bundles, errors, lifecycle
from backend.db import transaction
from backend.models import Attempt, Run, utcnow
from backend.schemas import PoolOut, SlurmJobOut, SlurmNodeOut
from torchyard.settings import PoolConfig, Settings
from torchyard.spec import ResourcesConfig, RunSpec, ScriptConfig
from torchyard.states import TERMINAL

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT_S = 30.0
WATCH_ENDED_S = 300.0  # an ended attempt's job is watched this long (it may still wind down)
UNRECORDED_AFTER_S = 60.0  # an attempt still without its job id this long after it was made: sbatch never ran
REPORT_GRACE_S = 3.0  # a job that ended: how long its agents' exit reports may take to reach ingest
CANCEL_SLACK_S = 10.0  # past the run's cancel grace, a running job still there is scancelled
TIME_SLACK_S = 120.0  # a job's time limit past max_duration_s: start-up, and Slurm's minute resolution
PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
LIVE = PENDING | {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING"}
NODE_FAILURES = {"NODE_FAIL", "BOOT_FAIL", "PREEMPTED"}
# Settings the node agents need (a worker's), never the database's or the api's secrets.
NODE_SETTINGS = (
    "api_url", "cancel_grace_s", "run_user", "run_tmp_bytes", "run_shm_bytes", "fr_buffer_entries",
    "max_log_line_bytes", "dataset_store", "dataset_s3_endpoint_url", "dataset_s3_region",
    "dataset_s3_access_key_id", "dataset_s3_secret_access_key", "dataset_url_ttl_s",
)  # fmt: skip
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")  # the job's environment: nothing else of ours


class SlurmError(Exception):
    """A Slurm command failed; the message is Slurm's own."""


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # JobState: PENDING, RUNNING, COMPLETED, NODE_FAIL, ...
    reason: str  # Reason: Resources, Priority, BeginTime, ... ("None" when none)
    restarts: int
    nodes: str
    exit_code: str
    partition: str


class SlurmClient:
    """Slurm's commands against one pool's cluster (its slurm.conf when the pool names one)."""

    def __init__(self, pool: PoolConfig) -> None:
        self.pool = pool
        self.env = {**os.environ, **({"SLURM_CONF": pool.slurm_conf} if pool.slurm_conf else {})}

    def run(self, *command: str) -> str:
        try:
            done = subprocess.run(
                command, env=self.env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmError(f"{command[0]}: {exc}") from None
        if done.returncode != 0:
            raise SlurmError((done.stderr or done.stdout).strip() or f"{command[0]} exited with {done.returncode}")
        return done.stdout

    def partitions(self) -> tuple[dict[str, int], str]:
        """Each partition's node count, and the default partition ("" when there is none)."""
        counts: dict[str, int] = {}
        default = ""
        for line in self.run("sinfo", "-h", "-a", "-o", "%P|%D").splitlines():
            name, _, count = line.strip().partition("|")
            if not name:
                continue
            if name.endswith("*"):
                name = default = name[:-1]
            counts[name] = counts.get(name, 0) + int(count or 0)
        return counts, default

    def nodes(self) -> list[dict[str, str]]:
        """Every node of every partition (sinfo -N): name, partition, state, CPUs, GRES (GPUs)."""
        out = self.run("sinfo", "-h", "-N", "-a", "-o", "%N|%P|%t|%c|%G")
        rows = []
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 5:
                name, partition, state, cpus, gres = parts
                rows.append(
                    {"name": name, "partition": partition.rstrip("*"), "state": state, "cpus": cpus, "gres": gres}
                )
        return rows

    def submit(self, script: Path, options: list[str]) -> str:
        out = self.run("sbatch", "--parsable", *options, str(script))
        return out.strip().split(";", 1)[0]

    def job(self, job_id: str) -> JobState | None:
        """The job as slurmctld knows it; None once it has forgotten it (past MinJobAge)."""
        try:
            out = self.run("scontrol", "show", "job", "-o", job_id)
        except SlurmError as exc:
            if "Invalid job id" in str(exc):
                return None
            raise
        return parse_job(job_id, out)

    def cancel(self, job_id: str) -> None:
        """scancel: Slurm sends SIGTERM to every process of the job, SIGKILL after its KillWait."""
        try:
            self.run("scancel", job_id)
        except SlurmError as exc:
            log.warning("scancel %s: %s", job_id, exc)


def parse_job(job_id: str, out: str) -> JobState:
    def field(name: str, default: str = "") -> str:
        found = re.search(rf"(?:^|\s){name}=(.*?)(?=\s\w[\w/:]*=|$)", out.strip())
        return found.group(1) if found else default

    return JobState(
        job_id,
        field("JobState").split()[0] if field("JobState") else "UNKNOWN",
        field("Reason", "None"),
        int(field("Restarts", "0") or 0),
        field("NodeList"),
        field("ExitCode"),
        field("Partition"),
    )


def pool_of(settings: Settings, run: Run) -> str | None:
    """The name of the run's pool; None when its pool is no longer configured."""
    try:
        return settings.pool(run.run_spec.resources.pool).name
    except KeyError:
        return None


def job_name(run_id: int) -> str:
    return f"torchyard-run-{run_id}"


def time_limit(max_duration_s: float) -> str | None:
    """sbatch --time in minutes: the run's own bound plus slack (our watchdog stops it on the dot)."""
    if not max_duration_s:
        return None
    return str(math.ceil((max_duration_s + TIME_SLACK_S) / 60))


def check_resources(pool: PoolConfig, res: ResourcesConfig) -> list[str]:
    """At submit: the partition must exist and hold the run's nodes (a 422 naming it). A cluster
    that does not answer is no fault of the spec: the run waits with a warning."""
    try:
        counts, default = SlurmClient(pool).partitions()
    except SlurmError as exc:
        return [f"Slurm pool {pool.name!r} did not answer ({exc}); the run waits to be submitted"]
    partition = res.partition or pool.partition
    if partition and partition not in counts:
        where = "resources.partition" if res.partition else f"pool {pool.name!r}'s partition"
        raise errors.InvalidRequest(
            ["body", "resources", "partition"],
            f"{where} ({partition!r}) is not a partition of Slurm pool {pool.name!r}: "
            + (", ".join(sorted(counts)) or "it has none"),
            partition,
        )
    name = partition or default
    if name and res.nodes > counts.get(name, 0):
        raise errors.InvalidRequest(
            ["body", "resources", "nodes"],
            f"resources.nodes ({res.nodes}): partition {name!r} of Slurm pool {pool.name!r} has "
            f"{counts.get(name, 0)} node(s)",
            res.nodes,
        )
    return []


@dataclass(frozen=True)
class Submission:
    run_id: int
    attempt: int
    spec: dict


class SlurmExecutor:
    """A Slurm pool's runs: submitted, watched and cancelled on each pass of the scheduler's leader."""

    kind = "slurm"

    def __init__(self, pool: PoolConfig, settings: Settings) -> None:
        self.pool, self.settings = pool, settings
        self.client = SlurmClient(pool)
        self.work_dir = settings.slurm_work_dir(pool)
        self._ended_seen: dict[str, float] = {}  # job -> when a pass first saw it ended unsettled
        self._cancel_seen: dict[str, float] = {}  # job -> when a pass first saw its run cancelling
        self._released: set[tuple[str, int]] = set()  # (job, restarts) let start at once after a requeue
        self._scancelled: set[str] = set()  # jobs scancel was sent to (once is enough)
        self._gone: dict[str, float] = {}  # jobs that ended with their attempt settled: asked no more

    def check(self, session: Session, res: ResourcesConfig, allow_waiting: bool) -> list[str]:
        return check_resources(self.pool, res)

    def owns(self, run: Run) -> bool:
        return pool_of(self.settings, run) == self.pool.name

    def pass_once(self, client: redis.Redis) -> None:
        with transaction() as session:
            self.watch(session)
            todo = self.make_attempts(session)
        for item in todo:
            self.submit(client, item)

    def make_attempts(self, session: Session) -> list[Submission]:
        """Waiting runs of this pool get their next attempt, marked as Slurm's (the job id follows)."""
        waiting = session.scalars(
            select(Run)
            .where(Run.status.in_((lifecycle.QUEUED, lifecycle.RESTARTING)))
            .order_by(Run.priority.desc(), Run.created_at, Run.id)
        ).all()
        todo = []
        for run in waiting:
            if not self.owns(run):
                continue
            if run.attempts and (job := run.attempts[-1].slurm_job_id) and self._still_live(job):
                continue  # Slurm may requeue it (then it runs the next attempt): a new job only once it ended
            number = len(run.attempts) + 1
            attempt = Attempt(number=number, status=lifecycle.SCHEDULED, slurm_job_id="")
            run.attempts.append(attempt)
            session.flush()
            lifecycle.transition(
                session, run, lifecycle.SCHEDULED, f"submitting to Slurm pool {self.pool.name} (attempt {number})"
            )
            todo.append(Submission(run.id, number, run.spec))
        return todo

    def _still_live(self, job_id: str) -> bool:
        try:
            state = self.client.job(job_id)
        except SlurmError:
            return True  # not known: ask again next pass
        return state is not None and state.state in LIVE

    def submit(self, client: redis.Redis, item: Submission) -> None:
        """sbatch, after the attempt committed; records the job id, or fails the run with Slurm's
        own message when sbatch refuses the job."""
        attempts.open_run_streams(client, item.run_id)
        try:
            script, options = self.batch_job(item)
            job_id = self.client.submit(script, options)
        except SlurmError as exc:
            with transaction() as session:
                run, attempt = _run_attempt(session, item.run_id, item.attempt)
                attempts.end_attempt(session, attempt, lifecycle.FAILED)
                if lifecycle.can_transition(run, lifecycle.FAILED):
                    lifecycle.transition(session, run, lifecycle.FAILED, f"sbatch refused the job: {exc}")
            return
        with transaction() as session:
            run, attempt = _run_attempt(session, item.run_id, item.attempt)
            attempt.slurm_job_id = job_id
            if run.status == lifecycle.SCHEDULED:
                run.status_reason = f"submitted to Slurm pool {self.pool.name} as job {job_id}"
        log.info("run %s attempt %s: Slurm job %s", item.run_id, item.attempt, job_id)

    def batch_job(self, item: Submission) -> tuple[Path, list[str]]:
        """The job file (what the node agents need: 0600, never in the job's environment), the
        batch script, and sbatch's options."""
        spec = RunSpec.model_validate(item.spec)
        res, settings = spec.resources, self.settings
        jobs = self.work_dir / "jobs"
        jobs.mkdir(parents=True, exist_ok=True)
        jobs.chmod(0o700)
        stem = jobs / f"run-{item.run_id}-attempt-{item.attempt}"
        values = settings.model_dump(mode="json")
        env = {f"TORCHYARD_{k.upper()}": str(values[k]) for k in NODE_SETTINGS if values.get(k) not in ("", None)}
        env.update(
            TORCHYARD_REDIS_URL=self.pool.node_redis_url or settings.redis_url,
            TORCHYARD_CHECKPOINT_ROOT=str(settings.checkpoints),  # shared: a later attempt resumes from it
            TORCHYARD_DATASET_ROOT=str(settings.datasets),
        )
        job = {
            "run_id": item.run_id,
            "attempt": item.attempt,
            "spec": item.spec,
            "pool": self.pool.name,
            "work_dir": str(self.work_dir),
            "cancel_token": attempts.cancel_token(settings, item.run_id),
            "bundle_capability": bundles.capability(settings, spec.workload.bundle)
            if isinstance(spec.workload, ScriptConfig)
            else None,
            "env": env,
        }
        job_file = stem.with_suffix(".json")
        fd = os.open(job_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(job, f)
        python = self.pool.python or sys.executable
        script = stem.with_suffix(".sh")
        script.write_text(
            "#!/bin/bash\n"
            f"# torchyard run {item.run_id}, attempt {item.attempt}: one node agent per node (workers/slurm_step.py)\n"
            f"export PYTHONPATH={PROJECT_ROOT}\n"
            'exec srun --export=ALL --ntasks-per-node=1 --kill-on-bad-exit=0 --cpus-per-task="$SLURM_CPUS_PER_TASK" '
            f"{python} -m workers.slurm_step {job_file}\n"
        )
        passed = [k for k in PASSED_ENV if k in os.environ] + (["SLURM_CONF"] if self.pool.slurm_conf else [])
        options = [
            f"--job-name={job_name(item.run_id)}",
            f"--nodes={res.nodes}",
            "--ntasks-per-node=1",
            f"--cpus-per-task={res.procs_per_node}",
            "--requeue",
            f"--export={','.join(passed) or 'NONE'}",
            f"--output={stem}-%j.out",
            f"--chdir={self.work_dir}",
        ]
        if res.device == "cuda":
            options.append(f"--gpus-per-node={res.procs_per_node}")
        if limit := time_limit(spec.training.max_duration_s):
            options.append(f"--time={limit}")
        if partition := res.partition or self.pool.partition:
            options.append(f"--partition={partition}")
        if self.pool.account:
            options.append(f"--account={self.pool.account}")
        return script, options

    def watch(self, session: Session) -> None:
        """Every job of this pool that may still change something: its attempt not ended, its run
        cancelling, or its attempt ended a short while ago (the job may still be winding down)."""
        recent = utcnow() - timedelta(seconds=WATCH_ENDED_S)
        rows = session.execute(
            select(Attempt, Run)
            .join(Run, Attempt.run_id == Run.id)
            .where(
                Attempt.slurm_job_id.is_not(None),
                Attempt.slurm_job_id != "",
                or_(Attempt.ended_at.is_(None), Attempt.ended_at > recent, Run.status == lifecycle.CANCELLING),
            )
            .order_by(Attempt.run_id, Attempt.number)
        ).all()
        self._adopt_unrecorded(session)
        latest: dict[str, tuple[Attempt, Run]] = {}
        for attempt, run in rows:  # a requeued job carries several attempts: the newest speaks for it
            if self.owns(run):
                latest[attempt.slurm_job_id or ""] = (attempt, run)
        now = time.monotonic()
        for job, at in list(self._gone.items()):
            if now - at > 2 * WATCH_ENDED_S:
                del self._gone[job]
        for job_id, (attempt, run) in latest.items():
            if job_id in self._gone:
                continue
            try:
                state = self.client.job(job_id)
            except SlurmError as exc:
                log.warning("Slurm job %s of run %s: %s", job_id, run.id, exc)
                continue
            self._follow(session, job_id, attempt, run, state)

    def _adopt_unrecorded(self, session: Session) -> None:
        """An attempt whose sbatch answer was never recorded (the service died between its commit and
        sbatch, or right after): its job is found by name and adopted, or the submission was lost and
        the run gets another attempt."""
        cutoff = utcnow() - timedelta(seconds=UNRECORDED_AFTER_S)
        rows = session.execute(
            select(Attempt, Run)
            .join(Run, Attempt.run_id == Run.id)
            .where(Attempt.slurm_job_id == "", Attempt.ended_at.is_(None), Attempt.created_at < cutoff)
        ).all()
        for attempt, run in rows:
            if not self.owns(run):
                continue
            try:
                found = self.client.run("squeue", "-h", "-n", job_name(run.id), "-o", "%i").split()
            except SlurmError as exc:
                log.warning("run %s: could not look for its Slurm job: %s", run.id, exc)
                continue
            if found:
                attempt.slurm_job_id = found[-1]
                continue
            attempts.end_attempt(session, attempt, lifecycle.FAILED)
            attempts.fail_or_restart(session, run, f"its submission to Slurm pool {self.pool.name} was lost")

    def _follow(self, session: Session, job_id: str, attempt: Attempt, run: Run, state: JobState | None) -> None:
        now = time.monotonic()
        if state is None:  # slurmctld forgot it (or never had it)
            if attempt.ended_at is None:
                self._settle(session, attempt, run, JobState(job_id, "UNKNOWN", "None", 0, "", "", ""))
            self._forget(job_id, attempt)
            return
        live = state.state in LIVE
        first_of_job = min(a.number for a in run.attempts if a.slurm_job_id == job_id)
        if live and state.restarts > attempt.number - first_of_job:
            self._requeued(session, job_id, attempt, run, state, first_of_job)
            return
        if live and (run.status in (lifecycle.CANCELLING, *TERMINAL) or attempt.ended_at is not None):
            # Cancelled, or over (an agent's report, the watchdog): a job that never started goes at
            # once; a running one is ended by its agents (cancel or end key, with the run's grace),
            # and scancelled (SIGTERM, SIGKILL after KillWait) if it is still there past that grace.
            grace = run.run_spec.training.cancel_grace(self.settings.cancel_grace_s)
            seen = self._cancel_seen.setdefault(job_id, now)
            due = state.state in PENDING or attempt.started_at is None or now - seen > grace + CANCEL_SLACK_S
            if due and job_id not in self._scancelled:
                self._scancelled.add(job_id)
                self.client.cancel(job_id)
            return
        if state.state in PENDING:
            if state.restarts and state.reason == "BeginTime" and (job_id, state.restarts) not in self._released:
                self._release(job_id, state.restarts)
            if run.status == lifecycle.SCHEDULED:
                reason = f"pending in Slurm pool {self.pool.name} as job {job_id}: {state.state} ({state.reason})"
                if run.status_reason != reason:
                    run.status_reason = reason
            return
        if live or attempt.ended_at is not None:
            if not live:
                self._forget(job_id, attempt)
            return
        if state.state != "COMPLETED":  # the agents' own reports say more: give them a moment
            first = self._ended_seen.setdefault(job_id, now)
            if now - first < REPORT_GRACE_S:
                return
        self._settle(session, attempt, run, state)
        self._forget(job_id, attempt)

    def _settle(self, session: Session, attempt: Attempt, run: Run, state: JobState) -> None:
        """The job ended and no report ended its attempt: its Slurm state says how."""
        job, what = state.job_id, state.state
        if what == "COMPLETED":
            attempts.end_attempt(session, attempt, lifecycle.SUCCEEDED, 0)
            if lifecycle.can_transition(run, lifecycle.SUCCEEDED):
                lifecycle.transition(session, run, lifecycle.SUCCEEDED, f"every node of Slurm job {job} succeeded")
            return
        cancelling = run.status == lifecycle.CANCELLING
        attempts.end_attempt(session, attempt, lifecycle.CANCELLED if cancelling else lifecycle.FAILED)
        if cancelling:
            lifecycle.transition(
                session,
                run,
                lifecycle.CANCELLED,
                f"cancelled: Slurm job {job} ended ({what}); no process of it is left",
            )
            return
        why = f"Slurm job {job} ended {what}" + (f" ({state.reason})" if state.reason not in ("", "None") else "")
        if what in NODE_FAILURES or what == "UNKNOWN":
            attempts.fail_or_restart(session, run, why)
            return
        if what == "TIMEOUT":
            why += ": it reached its time limit (training.max_duration_s + slack)"
        elif what == "CANCELLED":
            why += ": cancelled in Slurm, not through torchyard"
        elif state.exit_code:
            why += f", exit code {state.exit_code}" + self._output_tail(attempt)
        if lifecycle.can_transition(run, lifecycle.FAILED):
            lifecycle.transition(session, run, lifecycle.FAILED, why)

    def _requeued(self, session: Session, job_id: str, attempt: Attempt, run: Run, state: JobState, first: int) -> None:
        """Slurm requeued the job (a node failed): the job's next run is a new attempt, which resumes
        from the last checkpoint; out of attempts, the job is cancelled and the run fails."""
        if run.attempts[-1].slurm_job_id != job_id or run.status in (lifecycle.CANCELLING, *TERMINAL):
            if job_id not in self._scancelled:  # the run went on in another job, or is over
                self._scancelled.add(job_id)
                self.client.cancel(job_id)
            return
        if attempt.ended_at is None:
            attempts.end_attempt(session, attempt, lifecycle.FAILED)
        if run.status != lifecycle.RESTARTING:
            attempts.fail_or_restart(session, run, f"Slurm requeued job {job_id} (a node failed)")
        if run.status != lifecycle.RESTARTING:  # out of attempts: failed
            self.client.cancel(job_id)
            return
        number = first + state.restarts
        run.attempts.append(Attempt(number=number, status=lifecycle.SCHEDULED, slurm_job_id=job_id))
        session.flush()
        lifecycle.transition(
            session,
            run,
            lifecycle.SCHEDULED,
            f"Slurm requeued job {job_id}: attempt {number} resumes from the last checkpoint",
        )

    def _release(self, job_id: str, restarts: int) -> None:
        """Slurm holds a requeued job back (BeginTime, ~2 minutes): it may start once nodes are free."""
        self._released.add((job_id, restarts))
        try:
            self.client.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        except SlurmError as exc:
            log.info("could not release requeued job %s at once: %s", job_id, exc)

    def _output_tail(self, attempt: Attempt, lines: int = 20) -> str:
        found = sorted((self.work_dir / "jobs").glob(f"run-{attempt.run_id}-attempt-*-{attempt.slurm_job_id}.out"))
        if not found:
            return ""
        tail = found[-1].read_text(errors="replace").splitlines()[-lines:]
        return ("; the job's output ends:\n" + "\n".join(tail)) if tail else ""

    def _forget(self, job_id: str, attempt: Attempt) -> None:
        """The job ended and its attempt is settled: not asked about again; its files go."""
        self._ended_seen.pop(job_id, None)
        self._cancel_seen.pop(job_id, None)
        self._scancelled.discard(job_id)
        self._gone[job_id] = time.monotonic()
        for path in (self.work_dir / "jobs").glob(f"run-{attempt.run_id}-attempt-*"):
            number = re.match(r"run-\d+-attempt-(\d+)", path.name)
            if number and int(number.group(1)) <= attempt.number:  # never a later attempt's (a new job)
                path.unlink(missing_ok=True)


def _run_attempt(session: Session, run_id: int, number: int) -> tuple[Run, Attempt]:
    attempt = session.scalars(select(Attempt).where(Attempt.run_id == run_id, Attempt.number == number)).one()
    return attempt.run, attempt


def describe_pool(session: Session, settings: Settings, pool: PoolConfig, default: bool) -> PoolOut:
    """A pool for the cluster page; a Slurm pool with its partitions and nodes as sinfo says now."""
    out = PoolOut(
        name=pool.name, executor=pool.executor, default=default, partition=pool.partition, account=pool.account
    )
    if pool.executor != "slurm":
        return out
    rows = session.execute(
        select(Attempt, Run)
        .join(Run, Attempt.run_id == Run.id)
        .where(Attempt.slurm_job_id.is_not(None), Attempt.ended_at.is_(None))
        .order_by(Attempt.run_id)
    ).all()
    out.jobs = [
        SlurmJobOut(run_id=run.id, attempt=a.number, job_id=a.slurm_job_id or "", status=run.status)
        for a, run in rows
        if pool_of(settings, run) == pool.name
    ]
    client = SlurmClient(pool)
    try:
        out.partitions, out.default_partition = client.partitions()
        out.nodes = [SlurmNodeOut(**row) for row in client.nodes()]
    except SlurmError as exc:
        out.error = str(exc)
    return out
