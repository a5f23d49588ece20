"""Executors: what runs a pool's runs (``TORCHYARD_POOLS``; a run's spec names its pool in
``resources.pool``, else the default pool applies). Two kinds:

- ``workers``: the built-in pool, torchyard's own workers (what ``torchyard up`` starts). Its gang
  scheduler (``scheduler.py``) places runs on nodes with free slots and Celery carries each share.
- ``slurm``: an existing Slurm cluster (``slurm.py``, and the ``slurm_*.py`` beside it). Slurm
  gang-schedules; torchyard submits, watches and cancels its jobs.

Both are asked the same two things: at submit, whether the run's resources can ever be met (a
422 naming the field when not; warnings when the run must wait), and, on each pass of the
scheduler's leader, to move their runs along. The rank runtime, the streams and the run states are
the same for both: a run page does not show which pool ran it, except in its reasons."""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import redis
from sqlalchemy.orm import Session

from backend import errors, nodes, scheduler, slurm
from torchyard.settings import PoolConfig, Settings
from torchyard.spec import ResourcesConfig

log = logging.getLogger(__name__)


class Executor(Protocol):
    kind: str
    pool: PoolConfig

    def check(self, session: Session, res: ResourcesConfig, allow_waiting: bool) -> list[str]:
        """At submit: raises ``InvalidRequest`` naming the field the pool can never meet; returns
        warnings (why the run will wait)."""
        ...

    def pass_once(self, client: redis.Redis) -> None:
        """One pass of the scheduler's leader: place or submit waiting runs, follow running ones."""
        ...


class WorkersExecutor:
    kind = "workers"

    def __init__(self, pool: PoolConfig, settings: Settings) -> None:
        self.pool, self.settings = pool, settings

    def check(self, session: Session, res: ResourcesConfig, allow_waiting: bool) -> list[str]:
        if res.partition:
            raise errors.InvalidRequest(
                ["body", "resources", "partition"],
                f"resources.partition ({res.partition!r}) applies to Slurm pools only; pool {self.pool.name!r} "
                "is torchyard's own workers",
                res.partition,
            )
        return nodes.check_can_hold(session, res, allow_waiting)

    def pass_once(self, client: redis.Redis) -> None:
        scheduler.schedule_once(client, self.settings)


_executors: dict[tuple[str, PoolConfig], Executor] = {}


def pool_for(settings: Settings, res: ResourcesConfig) -> PoolConfig:
    """The run's pool; a 422 naming ``resources.pool`` when there is no such pool."""
    try:
        return settings.pool(res.pool)
    except KeyError:
        known = ", ".join(f"{p.name} ({p.executor})" for p in settings.pools)
        raise errors.InvalidRequest(
            ["body", "resources", "pool"], f"resources.pool ({res.pool!r}) is not a pool here: {known}", res.pool
        ) from None


def executor_for(pool: PoolConfig, settings: Settings) -> Executor:
    """One executor per pool and settings (a Slurm executor remembers what it saw between passes)."""
    key = (str(settings.state_dir), pool)
    if key not in _executors:
        _executors[key] = (
            WorkersExecutor(pool, settings) if pool.executor == "workers" else slurm.SlurmExecutor(pool, settings)
        )
    return _executors[key]


def pass_once(client: redis.Redis, settings: Settings) -> None:
    """Every pool's executor, the built-in one first; one pool's failure does not stop the others."""
    if not any(p.executor == "workers" for p in settings.pools):  # lost nodes, watchdog, reconcile still run
        scheduler.schedule_once(client, settings)
    for pool in sorted(settings.pools, key=lambda p: p.executor != "workers"):
        try:
            executor_for(pool, settings).pass_once(client)
        except Exception:
            log.exception("pool %s: scheduler pass failed; retrying", pool.name)


def serve(stop: threading.Event | None = None) -> None:
    """The scheduler's leader loop (``scheduler.serve``), each pass over every pool."""
    scheduler.serve(stop, pass_once)
