"""What Redis is told about runs once their rows commit: a new run's streams start empty and the
scheduler is woken; a cancelled run's workers find its cancel key. Shared by the runs route and the
sweep controller, which create and cancel runs the same way."""

from __future__ import annotations

from typing import Any

from backend import attempts
from torchyard import streams
from torchyard.settings import Settings


def clear_streams(redis: Any, run_ids: list[int]) -> None:
    """Before the commit that makes the runs: nothing written under their ids before they existed (a
    planted report, fake metrics) is ever read, nor any trim mark; no scheduler pass has seen them."""
    for run_id in run_ids:
        redis.delete(streams.run_stream(run_id), streams.rank_stream(run_id), streams.trim_key(run_id))


def wake_scheduler(redis: Any, run_ids: list[int]) -> None:
    """After the commit: the scheduler places them now, not at its next interval."""
    if run_ids:
        redis.rpush(streams.SCHEDULER_WAKE, *run_ids)


def signal_cancel(redis: Any, settings: Settings, run_id: int) -> None:
    """After the commit that asked for the cancel: the worker running it polls this key; it outlives
    any run (a day) and costs nothing. Its value is the run's cancel token (which the worker got with
    its task): a key someone else sets without it is ignored, so it cannot cancel another's run."""
    redis.set(streams.cancel_key(run_id), attempts.cancel_token(settings, run_id), ex=86400)
