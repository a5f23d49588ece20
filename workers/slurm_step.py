"""One node's share of a run in a Slurm job: ``srun`` starts this once per node of the allocation
(``python -m workers.slurm_step JOB_FILE``), and it does what a Celery worker does with a share
(``launcher.run_and_report``): the attempt's own Redis user for the ranks, one torchrun per node
with a c10d rendezvous on node rank 0 (``SLURM_NODEID`` 0, the first node of
``SLURM_JOB_NODELIST``: it opens the store on a free port of its ``NodeAddr`` and publishes it, as a
worker does),
the ranks as the unprivileged run user when root, their output pumped line by line to the run's
platform stream, the cancel key obeyed, and its exit reported. It is platform code on the node, as
a worker is: the job file (0600, written by the service) gives it a worker's Redis credential and
the attempt's cancel token, and nothing of the database.

Its node id is ``slurm-<pool>-<node>``; its state (run directories) lies under the pool's work
dir, one folder per node. A requeued job (Slurm restarts it after a node failure) runs the next
attempt: the job file's attempt + ``SLURM_RESTART_COUNT``, which the service has made by then."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import FrameType

import redis

from torchyard import streams
from torchyard.settings import Settings
from torchyard.states import AttemptState
from workers import launcher
from workers.rundirs import stopping_marker

log = logging.getLogger("torchyard.slurm_step")


_settings: Settings | None = None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Slurm ends the job (scancel, a node failure, preemption): its SIGTERM reaches the ranks too.
    The agent lives on to report: a cancel through torchyard is a cancel (the cancel key), anything
    else the node's doing, not the run's (the stopping marker makes the exit retryable, as a worker's
    shutdown does). Dying here would leave the share unreported."""
    log.info("SIGTERM from Slurm: the ranks end; reporting how")
    if _settings is not None:
        stopping_marker(_settings).parent.mkdir(parents=True, exist_ok=True)
        stopping_marker(_settings).touch()


def node_address(node: str) -> str:
    """The node's address as Slurm knows it (``NodeAddr``): what the other nodes reach it at."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        found = re.search(r"\bNodeAddr=(\S+)", out)
        if found:
            return found.group(1)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not ask Slurm for %s's address (%s); using its host name", node, exc)
    return socket.gethostname()


def first_of(nodelist: str) -> str:
    """The first node of a Slurm node list (``n[1-2],gpu3`` -> ``n1``): node rank 0, the rendezvous host."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
        return out[0] if out else nodelist
    except (OSError, subprocess.SubprocessError):
        return nodelist


def attempt_number(job: dict) -> int:
    return int(job["attempt"]) + int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    job = json.loads(Path(argv[1]).read_text())
    node = os.environ["SLURMD_NODENAME"]
    node_rank, nnodes = int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_JOB_NUM_NODES"])
    first_node = first_of(os.environ.get("SLURM_JOB_NODELIST", node))
    os.environ.update(job["env"])
    # The job's own state dir on the node: its markers are its own, and it goes with the job.
    state_dir = Path(job["work_dir"]) / "nodes" / node / f"job-{os.environ.get('SLURM_JOB_ID', '0')}"
    os.environ.update(TORCHYARD_STATE_DIR=str(state_dir), TORCHYARD_NODE_ID=f"slurm-{job['pool']}-{node}")
    os.environ["TORCHYARD_NODE_HOST"] = node_address(node)  # on node rank 0: where the c10d store listens
    global _settings
    settings = _settings = Settings()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    settings.state_dir.chmod(0o700)
    stopping_marker(settings).unlink(missing_ok=True)  # a requeued job's earlier run left it
    try:
        return _run(settings, job, node, node_rank, nnodes, first_node)
    finally:
        shutil.rmtree(settings.state_dir, ignore_errors=True)


def _run(settings: Settings, job: dict, node: str, node_rank: int, nnodes: int, first_node: str) -> int:
    run_id, attempt = int(job["run_id"]), attempt_number(job)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=30)
    claim = streams.attempt_claim_key(run_id, attempt, node_rank)
    if not client.set(claim, settings.node_id, nx=True, ex=7 * 86400):
        log.info("run %s attempt %s node rank %s is already claimed: nothing to do", run_id, attempt, node_rank)
        return 1
    outcome = launcher.run_and_report(
        client, settings, run_id, attempt, job["spec"], job.get("bundle_capability"),
        node_rank, nnodes, first_node, job["cancel_token"],
    )  # fmt: skip
    log.info("run %s attempt %s on %s: %s", run_id, attempt, node, outcome.status)
    return 0 if outcome.status == AttemptState.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
