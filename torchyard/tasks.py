"""What the api and the workers agree on about Celery: the task's name, the node queues and the
app's settings. The api dispatches by name (``send_task``) and never imports the worker's code."""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery

RUN_ATTEMPT_TASK = "torchyard.run_attempt"  # args: run_id, attempt, spec[, bundle capability]; kwargs: the gang


def node_queue(node_id: str) -> str:
    return f"node.{node_id}"


def make_celery(broker_url: str, include: Sequence[str] = ()) -> Celery:
    """The Celery app, for the side that sends (no ``include``) and the side that runs tasks."""
    app = Celery("torchyard", broker=broker_url, include=list(include))
    app.conf.update(
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        # A share that waits for a busy node must not be redelivered to a second pool child.
        broker_transport_options={"visibility_timeout": 7 * 24 * 3600},
        worker_hijack_root_logger=False,
        worker_send_task_events=True,
        task_send_sent_event=True,
    )
    return app
