"""Thin Celery tasks: claim, delegate to the launcher, report. A second delivery of the same
attempt finds the claim and does nothing."""

from __future__ import annotations

import logging
import traceback
from functools import lru_cache

import redis

from torchyard import streams
from torchyard.settings import get_settings
from workers import launcher
from workers.celery_app import RUN_ATTEMPT_TASK, app

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
) -> str:
    settings, client = get_settings(), _redis()
    claim = streams.attempt_claim_key(run_id, attempt, node_rank)
    if not client.set(claim, settings.node_id, nx=True, ex=7 * 86400):
        log.info("run %s attempt %s node rank %s is already claimed: duplicate ignored", run_id, attempt, node_rank)
        return "duplicate"
    if client.exists(streams.cancel_key(run_id)):
        outcome = launcher.Outcome("cancelled", None, "cancelled before it started")
    else:
        try:
            gang = launcher.join_gang(client, settings, run_id, attempt, node_rank, nnodes, rdzv_host)
            if gang is None:
                outcome = launcher.Outcome("cancelled", None, "cancelled or ended while waiting for the gang")
            else:
                outcome = launcher.run_attempt(client, settings, run_id, attempt, spec, bundle_capability, gang)
        except Exception:
            log.exception("launching run %s attempt %s failed", run_id, attempt)
            outcome = launcher.Outcome(
                "failed", None, "the worker could not launch the run:\n" + traceback.format_exc()
            )
    launcher.report(client, run_id, attempt, settings.node_id, "exited", status=outcome.status,
                    returncode=outcome.returncode, reason=outcome.reason, retryable=outcome.retryable)  # fmt: skip
    return outcome.status
