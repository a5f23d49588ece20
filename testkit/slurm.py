"""A Slurm cluster of two nodes on this one host, for tests: munged, ``slurmctld -D`` and two
``slurmd -D -N n1|n2`` (each on its own port, ``%n`` in their spool, pid and log paths), all from
Debian's packages (``slurmctld slurmd slurm-client munge``, 22.05), configured in a temp dir of
their own (slurm.conf, the munge key and socket), run as root without systemd. Nothing global is
touched: the client commands find the cluster through ``SLURM_CONF`` (``env``), and munge's
socket is named in slurm.conf (``AuthInfo=socket=``). ``stop`` ends every job, every daemon and
every job step's process it left (slurmstepd daemonizes: found by the ``SLURM_CONF`` it inherits)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
import pytest

from cli.wait import wait_for
from testkit.require import needs
from testkit.stack import RunningStack, mean_loss, sqlite_stack, submit_on_nodes
from torchyard.net import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")
SBIN = ("/usr/sbin", "/sbin")


def which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def missing() -> list[str]:
    """The Slurm/munge programs this host lacks (CI installs them: .ci/run)."""
    return [b for b in BINARIES if which(b) is None]


SKIP_REASON = (
    "the Slurm tests need Debian's slurmctld, slurmd, slurm-client and munge, run as root "
    "(`apt-get install -y slurmctld slurmd slurm-client munge`); missing: "
)


class SlurmCluster:
    """Two nodes (``n1``, ``n2``, ``cpus`` CPUs each, however many the host has: config_overrides)
    in one partition ``debug``. ``env`` is what a client command (or a service submitting jobs)
    needs in its environment."""

    def __init__(self, root: Path, nodes: tuple[str, ...] = ("n1", "n2"), cpus: int = 2, partition: str = "debug"):
        self.root, self.nodes, self.cpus, self.partition = root, nodes, cpus, partition
        self.conf = root / "slurm.conf"
        self.socket = root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.frozen: dict[str, list[psutil.Process]] = {}  # a failed node's processes (fail_node)
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        (self.root / "munge").mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(exist_ok=True)
        ports = [free_port() for _ in range(1 + len(self.nodes))]
        host = socket.gethostname()
        # Each node its own loopback address (127.0.0.1, .2, ...): torch's rendezvous tells nodes
        # apart by address and pid, and ranks in PID namespaces of their own may share a pid.
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.{i + 1} Port={port} CPUs={self.cpus} "
            f"RealMemory=2000 State=UNKNOWN"
            for i, (n, port) in enumerate(zip(self.nodes, ports[1:], strict=True))
        )
        r = self.root
        self.conf.write_text(
            f"""ClusterName=torchyard-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SlurmdTimeout=10
SlurmctldTimeout=10
ReturnToService=2
KillWait=5
MinJobAge=300
JobRequeue=1
MessageTimeout=10
{node_lines}
PartitionName={self.partition} Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _start(self, name: str, *command: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (the daemon holds it)
        self.procs[name] = subprocess.Popen(
            command, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        log.close()

    def start(self, timeout: float = 60) -> SlurmCluster:
        self.write_config()
        m = self.root / "munge"
        self._start(
            "munged", which("munged") or "munged", "--foreground", "--force", f"--socket={self.socket}",
            f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}",
            f"--log-file={m / 'munged.log'}",
        )  # fmt: skip
        wait_for(lambda: self.socket.exists() or self._died("munged"), 20, "munged's socket")
        self._start("slurmctld", which("slurmctld") or "slurmctld", "-D", "-f", str(self.conf))
        for n in self.nodes:
            self._start(f"slurmd-{n}", which("slurmd") or "slurmd", "-D", "-N", n, "-f", str(self.conf))
        wait_for(self._all_idle, timeout, f"Slurm nodes {', '.join(self.nodes)} to be idle (logs: {self.root / 'log'})")
        return self

    def _died(self, name: str) -> bool:
        code = self.procs[name].poll()
        if code is not None:
            raise AssertionError(f"{name} exited with {code}: see {self.root / 'log'}")
        return False

    def _all_idle(self) -> bool:
        for name in self.procs:
            self._died(name)
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def run(self, *command: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """A client command (sinfo, squeue, ...) against this cluster."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30, check=check)

    def jobs(self) -> list[str]:
        """Job ids squeue still shows (pending, running, completing)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def step_processes(self) -> list[psutil.Process]:
        """Every live process a job of this cluster runs (slurmstepd and what it started): they
        inherit SLURM_CONF from their slurmd, so it tells this cluster's from another's."""
        found = []
        daemons = {p.pid for p in self.procs.values()}
        for proc in psutil.process_iter(["pid"]):
            with suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if proc.pid in daemons or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                env = proc.environ()
                if env.get("SLURM_CONF") == str(self.conf) and ("SLURM_JOB_ID" in env or proc.name() == "slurmstepd"):
                    found.append(proc)
        return found

    def fail_node(self, node: str) -> None:
        """The node dies as a machine does: kill -9 its slurmd, and freeze every process of its job
        steps (SIGSTOP: none answers, none exits, no connection is reset; on one host a killed rank
        would reset its peers' connections at once, which a dead machine never does)."""
        proc = self.procs[f"slurmd-{node}"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        agents = [p for p in self.step_processes() if p.environ().get("SLURMD_NODENAME") == node]
        self.frozen[node] = [q for a in agents for q in (a.parent(), a, *a.children(recursive=True)) if q]
        for victim in self.frozen[node]:
            with suppress(psutil.NoSuchProcess):
                victim.suspend()

    def restart_node(self, node: str) -> None:
        """The node comes back (rebooted): its old processes are gone, its slurmd starts again."""
        for victim in self.frozen.pop(node, []):
            with suppress(psutil.NoSuchProcess):
                victim.kill()
        self._start(f"slurmd-{node}", which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf))

    def stop(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with suppress(Exception):
                self.run("scancel", "--full", "--signal=KILL", *self.jobs())
                wait_for(lambda: not self.jobs(), 20, "Slurm jobs to end", interval=0.2)
        for node in list(self.frozen):
            for victim in self.frozen.pop(node):
                with suppress(psutil.NoSuchProcess):
                    victim.kill()
        leftovers = self.step_processes()
        for name in sorted(self.procs, key=lambda n: n == "munged"):  # munged last: the others talk to it
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for proc in leftovers + self.step_processes():
            with suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(leftovers, timeout=5)


@contextmanager
def slurm_cluster(root: Path, **kwargs: object) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(root, **kwargs)  # type: ignore[arg-type]
    try:
        yield cluster.start()
    finally:
        cluster.stop()


class SlurmStack:
    """A Slurm cluster and a stack whose ``hpc`` pool is that cluster (``slurm_stack``)."""

    def __init__(self, cluster: SlurmCluster, stack: RunningStack) -> None:
        self.cluster, self.stack, self.client = cluster, stack, stack.client

    def submit(self, name: str, nodes: int, procs: int, pool: str = "hpc", **training: Any) -> int:
        return submit_on_nodes(self.client, name, nodes, procs, {"pool": pool}, **training)

    def mean_loss(self, run_id: int) -> list[float]:
        return mean_loss(self.client, run_id)

    def job_of(self, run_id: int) -> str:
        """The run's Slurm job id, from its status reason (``... as job N``) once it has one."""

        def found() -> str | None:
            reason = str(self.client.run(run_id)["status_reason"])
            for word in reason.replace(":", " ").split():
                if word.isdigit() and f"job {word}" in reason:
                    return word
            jobs = self.cluster.run("squeue", "-h", "-n", f"torchyard-run-{run_id}", "-o", "%i").stdout.split()
            return jobs[0] if jobs else None

        return wait_for(found, 30, f"run {run_id}'s Slurm job", interval=0.2)


@contextmanager
def slurm_stack(tmp: Path) -> Iterator[SlurmStack]:
    """A Slurm cluster of two nodes and a whole torchyard system on SQLite whose pools are the
    built-in ``local`` (the stack's own worker, the default) and ``hpc`` (that Slurm cluster)."""
    with slurm_cluster(tmp / "cluster") as cluster:
        pools = [
            {"name": "local", "executor": "workers"},
            {"name": "hpc", "executor": "slurm", "slurm_conf": str(cluster.conf), "work_dir": str(tmp / "hpc")},
        ]
        with sqlite_stack(tmp / "stack", pools=pools, default_pool="local") as stack:
            yield SlurmStack(cluster, stack)


def module_marks(*more: pytest.MarkDecorator) -> list[pytest.MarkDecorator]:
    """A Slurm test module's ``pytestmark``: its tier, ``more``, a 2-minute bound, the programs this
    host lacks (``testkit/require.py``: a skip naming them, a failure under CI, which installs them)
    and a skip where the tests do not run as root (a capability, not a broken setup)."""
    gone = missing()
    return [
        pytest.mark.slurm,
        *more,
        pytest.mark.timeout(120),
        needs(*([SKIP_REASON + ", ".join(gone)] if gone else [])),
        # without the programs that mark decides (a failure under CI), not this skip
        pytest.mark.skipif(
            not gone and os.geteuid() != 0, reason=SKIP_REASON + "root (slurmd runs jobs as their user)"
        ),
    ]


def module_stack(folder: str) -> Any:
    """A module-scoped fixture ``env``: the module's own Slurm cluster and stack (``slurm_stack``)
    under a temp folder named ``folder``; assign it as ``env = slurm.module_stack(...)``."""

    @pytest.fixture(scope="module")
    def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmStack]:
        with slurm_stack(tmp_path_factory.mktemp(folder)) as running:
            yield running

    return env


def wait_gone(cluster: SlurmCluster, job: str, timeout: float = 30) -> None:
    wait_for(lambda: job not in cluster.jobs(), timeout, f"Slurm job {job} to leave squeue", interval=0.2)
