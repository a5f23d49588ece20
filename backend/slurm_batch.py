"""A Slurm attempt's batch job: its files (the job file, the batch script, the output) and
sbatch's options.

One attempt = one batch job: ``--nodes`` N, ``--ntasks-per-node=1``, ``--cpus-per-task`` (the
run's processes per node), ``--gpus-per-node`` (a CUDA run), ``--time`` from
``training.max_duration_s``, the pool's partition and account, ``--requeue``, job name
``torchyard-run-<id>``. Its script runs one node agent per node through ``srun``
(``workers/slurm_step.py``): the same share runtime as a Celery worker (the attempt's own Redis
user for the ranks, torchrun with a c10d rendezvous on node rank 0, the log pump, the cancel key,
the started/exited reports), so live metrics, logs and state reach the run's streams exactly as
from our workers. Logs: pumped by the agent in the job step, not files tailed by the service: live,
through the same platform stream, and with no shared log directory to poll."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from backend import attempts, bundles
from backend.models import Attempt
from torchyard.runfiles import RunDir
from torchyard.settings import PoolConfig, Settings
from torchyard.spec import RunSpec, ScriptConfig

PROJECT_ROOT = Path(__file__).resolve().parent.parent
OUTPUT_TAIL_BYTES = 64 << 10  # of a failed job's output: enough for its last lines, whatever it printed
TIME_SLACK_S = 120.0  # a job's time limit past max_duration_s: start-up, and Slurm's minute resolution
# Settings the node agents need (a worker's), never the database's or the api's secrets.
NODE_SETTINGS = (
    "api_url", "cancel_grace_s", "run_user", "run_tmp_bytes", "run_shm_bytes", "fr_buffer_entries",
    "max_log_line_bytes", "dataset_store", "dataset_s3_endpoint_url", "dataset_s3_region",
    "dataset_s3_access_key_id", "dataset_s3_secret_access_key", "dataset_url_ttl_s",
)  # fmt: skip
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")  # the job's environment: nothing else of ours


@dataclass(frozen=True)
class Submission:
    run_id: int
    attempt: int
    spec: dict


def job_name(run_id: int) -> str:
    return f"torchyard-run-{run_id}"


def time_limit(max_duration_s: float) -> str | None:
    """sbatch --time in minutes: the run's own bound plus slack (our watchdog stops it on the dot)."""
    if not max_duration_s:
        return None
    return str(math.ceil((max_duration_s + TIME_SLACK_S) / 60))


def batch_job(pool: PoolConfig, settings: Settings, work_dir: Path, item: Submission) -> tuple[Path, list[str]]:
    """The job file (what the node agents need: 0600, never in the job's environment), the
    batch script, and sbatch's options."""
    spec = RunSpec.model_validate(item.spec)
    res = spec.resources
    jobs = work_dir / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    jobs.chmod(0o700)
    stem = jobs / f"run-{item.run_id}-attempt-{item.attempt}"
    values = settings.model_dump(mode="json")
    env = {f"TORCHYARD_{k.upper()}": str(values[k]) for k in NODE_SETTINGS if values.get(k) not in ("", None)}
    env.update(
        TORCHYARD_REDIS_URL=pool.node_redis_url or settings.redis_url,
        TORCHYARD_CHECKPOINT_ROOT=str(settings.checkpoints),  # shared: a later attempt resumes from it
        TORCHYARD_DATASET_ROOT=str(settings.datasets),
    )
    job = {
        "run_id": item.run_id,
        "attempt": item.attempt,
        "spec": item.spec,
        "pool": pool.name,
        "work_dir": str(work_dir),
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
    python = pool.python or sys.executable
    script = stem.with_suffix(".sh")
    script.write_text(
        "#!/bin/bash\n"
        f"# torchyard run {item.run_id}, attempt {item.attempt}: one node agent per node (workers/slurm_step.py)\n"
        f"export PYTHONPATH={PROJECT_ROOT}\n"
        'exec srun --export=ALL --ntasks-per-node=1 --kill-on-bad-exit=0 --cpus-per-task="$SLURM_CPUS_PER_TASK" '
        f"{python} -m workers.slurm_step {job_file}\n"
    )
    passed = [k for k in PASSED_ENV if k in os.environ] + (["SLURM_CONF"] if pool.slurm_conf else [])
    options = [
        f"--job-name={job_name(item.run_id)}",
        f"--nodes={res.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={res.procs_per_node}",
        "--requeue",
        f"--export={','.join(passed) or 'NONE'}",
        f"--output={stem}-%j.out",
        f"--chdir={work_dir}",
    ]
    if res.device == "cuda":
        options.append(f"--gpus-per-node={res.procs_per_node}")
    if limit := time_limit(spec.training.max_duration_s):
        options.append(f"--time={limit}")
    if partition := res.partition or pool.partition:
        options.append(f"--partition={partition}")
    if pool.account:
        options.append(f"--account={pool.account}")
    return script, options


def output_tail(work_dir: Path, attempt: Attempt, lines: int = 20) -> str:
    found = sorted((work_dir / "jobs").glob(f"run-{attempt.run_id}-attempt-*-{attempt.slurm_job_id}.out"))
    if not found:
        return ""
    try:  # the job's own output, written as the run's user: no link followed, its end alone read
        with RunDir.open(work_dir / "jobs") as jobs:
            text = jobs.read_tail(found[-1].name, OUTPUT_TAIL_BYTES).decode(errors="replace")
    except OSError:
        return ""
    tail = text.splitlines()[-lines:]
    return ("; the job's output ends:\n" + "\n".join(tail)) if tail else ""


def remove_job_files(work_dir: Path, attempt: Attempt) -> None:
    """The files of the attempt's job and of the attempts before it."""
    for path in (work_dir / "jobs").glob(f"run-{attempt.run_id}-attempt-*"):
        number = re.match(r"run-\d+-attempt-(\d+)", path.name)
        if number and int(number.group(1)) <= attempt.number:  # never a later attempt's (a new job)
            path.unlink(missing_ok=True)
