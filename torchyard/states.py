"""The states a run, an attempt and a node can be in: spelled here once, for every process (the
api's transition table in ``backend/lifecycle.py``, the worker's outcomes, the CLI, the tests).
A ``StrEnum`` member is its string, so it is stored, compared and sent as JSON unchanged."""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    RESTARTING = "restarting"  # a node was lost: a new attempt resumes from the last checkpoint


TERMINAL = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED})
ACTIVE = frozenset({RunState.SCHEDULED, RunState.RUNNING, RunState.CANCELLING})  # an attempt holds slots on a node


class AttemptState(StrEnum):
    """An attempt starts scheduled and ends in one of the three final run states; a node's share
    of it (its allocation) ends with one of these too, or LOST when its node disappeared."""

    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"


class NodeState(StrEnum):
    ALIVE = "alive"
    LOST = "lost"  # no heartbeat for node_timeout_s


class SweepState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # every trial ended, at least one with a value
    FAILED = "failed"  # every trial ended, none with a value
    CANCELLED = "cancelled"


class TrialState(StrEnum):
    """A sweep trial's state (Optuna's, as torchyard shows it)."""

    RUNNING = "running"  # its run is unfinished
    COMPLETE = "complete"  # its run succeeded and gave a value
    PRUNED = "pruned"  # stopped early by the pruner: its run cancelled
    FAILED = "failed"  # its run failed, gave no value, or its parameters made an invalid spec
    CANCELLED = "cancelled"  # its run was cancelled (the sweep, or its owner)
