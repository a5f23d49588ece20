"""Slurm pools as sinfo describes them: a run's pool, its partition and node count checked at
submit, and a pool for the cluster page (its partitions, nodes and live jobs)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend import errors
from backend.models import Attempt, Run
from backend.schemas import PoolOut, SlurmJobOut, SlurmNodeOut
from backend.slurm_client import SlurmClient, SlurmError
from torchyard.settings import PoolConfig, Settings
from torchyard.spec import ResourcesConfig


def pool_of(settings: Settings, run: Run) -> str | None:
    """The name of the run's pool; None when its pool is no longer configured."""
    try:
        return settings.pool(run.run_spec.resources.pool).name
    except KeyError:
        return None


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
