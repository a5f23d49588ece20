"""Slurm pools: runs handed to an existing Slurm cluster, which gang-schedules them itself. This
module is the executor: it submits each attempt, then watches its job and maps Slurm's job states
onto the run's. Slurm's commands and job states: ``slurm_client.py``; the batch job an attempt
runs as: ``slurm_batch.py``; partitions, nodes and the pool's description: ``slurm_pools.py``.

The scheduler's leader polls each live job (``scontrol show job``) every pass: Slurm's pending
reason becomes the run's ``status_reason``; a job that ends settles its attempt when no agent's
report did (COMPLETED is the only way a Slurm attempt succeeds: every node's step exited 0);
NODE_FAIL or PREEMPTED is the node's failure, not the run's (a new attempt, bounded by
``max_attempts``: the same job when Slurm requeued it, else a new one); a job Slurm requeued
runs the next attempt. Cancel: a pending job is scancelled at once; a running one is ended by its
agents on the run's cancel key with the run's grace, then scancelled if it is still there."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import redis
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from backend import attempts, lifecycle
from backend.db import transaction
from backend.models import Attempt, Run, utcnow
from backend.slurm_batch import Submission, batch_job, job_name, output_tail, remove_job_files
from backend.slurm_client import LIVE, NODE_FAILURES, PENDING, JobState, SlurmClient, SlurmError
from backend.slurm_pools import check_resources, pool_of
from torchyard.settings import PoolConfig, Settings
from torchyard.spec import ResourcesConfig
from torchyard.states import TERMINAL

log = logging.getLogger(__name__)
WATCH_ENDED_S = 300.0  # an ended attempt's job is watched this long (it may still wind down)
UNRECORDED_AFTER_S = 60.0  # an attempt still without its job id this long after it was made: sbatch never ran
REPORT_GRACE_S = 3.0  # a job that ended: how long its agents' exit reports may take to reach ingest
CANCEL_SLACK_S = 10.0  # past the run's cancel grace, a running job still there is scancelled


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
            script, options = batch_job(self.pool, self.settings, self.work_dir, item)
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
            why += f", exit code {state.exit_code}" + output_tail(self.work_dir, attempt)
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

    def _forget(self, job_id: str, attempt: Attempt) -> None:
        """The job ended and its attempt is settled: not asked about again; its files go."""
        self._ended_seen.pop(job_id, None)
        self._cancel_seen.pop(job_id, None)
        self._scancelled.discard(job_id)
        self._gone[job_id] = time.monotonic()
        remove_job_files(self.work_dir, attempt)


def _run_attempt(session: Session, run_id: int, number: int) -> tuple[Run, Attempt]:
    attempt = session.scalars(select(Attempt).where(Attempt.run_id == run_id, Attempt.number == number)).one()
    return attempt.run, attempt
