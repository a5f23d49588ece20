"""The worker's Celery app: it carries shares ("start your share of run R, attempt A") to a
node's queue. It does not carry liveness: with a Redis broker a long unacked task is delivered again
while it still runs, so tasks are acked on receipt and a run's liveness comes from heartbeats."""

from __future__ import annotations

from torchyard.settings import get_settings
from torchyard.tasks import make_celery

app = make_celery(get_settings().redis_url, include=["workers.tasks", "workers.node"])
