"""Slurm's own commands (``sbatch``, ``scontrol``, ``scancel``, ``squeue``, ``sinfo``) against
one pool's cluster, and the job states they answer with.

Why the commands, run as subprocesses: they come with every Slurm install (Debian's slurm-client),
speak the cluster's own auth (munge) and version, and need nothing else on the service host but the
cluster's slurm.conf and munge key. ``slurmrestd`` is a daemon more to run and secure (JWT), which
many clusters do not run; submitit submits pickled Python callables (its own job format) and polls
through ``sacct``, which needs slurmdbd. Accounting (``sacct``) is not used: a finished job's state
is read with ``scontrol show job`` while slurmctld keeps it (MinJobAge, 300 s by default)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from torchyard.settings import PoolConfig

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 30.0
PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
LIVE = PENDING | {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING"}
NODE_FAILURES = {"NODE_FAIL", "BOOT_FAIL", "PREEMPTED"}


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
