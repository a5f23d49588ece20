"""The Celery app: it carries placements ("start your share of run R, attempt A") to a node's
queue. It does not carry liveness: with a Redis broker a long unacked task is delivered again
while it still runs, so tasks are acked on receipt and a run's liveness comes from heartbeats."""

from __future__ import annotations

from celery import Celery

from torchyard.settings import get_settings

RUN_ATTEMPT_TASK = "torchyard.run_attempt"


def node_queue(node_id: str) -> str:
    return f"node.{node_id}"


def make_celery() -> Celery:
    app = Celery("torchyard", broker=get_settings().redis_url, include=["workers.tasks", "workers.node"])
    app.conf.update(
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        # A placement that waits for a busy node must not be redelivered to a second pool child.
        broker_transport_options={"visibility_timeout": 7 * 24 * 3600},
        worker_hijack_root_logger=False,
        worker_send_task_events=True,
        task_send_sent_event=True,
    )
    return app


app = make_celery()
