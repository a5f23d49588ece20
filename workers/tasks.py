"""Thin Celery tasks: claim, delegate to the launcher, report. A second delivery of the same
attempt finds the claim and does nothing."""

from __future__ import annotations

import logging
from functools import lru_cache

import redis

from torchyard import streams
from torchyard.settings import get_settings
from torchyard.tasks import RUN_ATTEMPT_TASK
from workers import launcher
from workers.celery_app import app

log = logging.getLogger(__name__)


@lru_cache
def _redis() -> redis.Redis:
    return redis.Redis.from_url(get_settings().redis_url, socket_timeout=10)


@app.task(name=RUN_ATTEMPT_TASK)
def run_attempt(
    run_id: int,
    attempt: int,
    spec: dict,
    bundle_capability: str | None = None,
    node_rank: int = 0,
    nnodes: int = 1,
    rdzv_host: str = "",
    cancel_token: str | None = None,
    gpus: list[int] | None = None,
) -> str:
    settings, client = get_settings(), _redis()
    claim = streams.attempt_claim_key(run_id, attempt, node_rank)
    if not client.set(claim, settings.node_id, nx=True, ex=7 * 86400):
        log.info("run %s attempt %s node rank %s is already claimed: duplicate ignored", run_id, attempt, node_rank)
        return "duplicate"
    outcome = launcher.run_and_report(
        client, settings, run_id, attempt, spec, bundle_capability, node_rank, nnodes, rdzv_host, cancel_token, gpus
    )
    return outcome.status
