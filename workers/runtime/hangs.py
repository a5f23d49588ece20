"""How the ``fail`` workload hangs (``params.hang_in``): the kinds of stuck run a hang diagnosis
must tell apart (``backend/diagnosis.py``), made on purpose.

- ``python``: the rank waits in Python at the step, outside any collective;
- ``data_loading``: the rank sleeps inside its data set while it loads the step's batch, so it never
  reaches the step's gradient all-reduce that the others wait in;
- ``skip_collective``: every other rank enters an all-reduce on a group of its own; this one skips
  it, does its step's work (``SKIP_WORK_S``: a real step's compute, long against a loaded host's
  scheduling jitter, so the others are waiting first, as they would be) and goes on into the step's
  gradient all-reduce, where it waits for them;
- ``other_collective``: this one calls a broadcast where the others all-reduce (a mismatch).

The collective kinds make their group when the workload is built (every rank must, in order)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from torchyard.spec import FailParams

SKIP_WORK_S = 0.3


class Armable(Protocol):
    armed: bool  # set: the next batch never comes (``workloads.LateBatches``)


def hang_at_step(params: FailParams, data: Armable | None) -> Callable[[int], None]:
    """The hang of ``params.hang_in``, as the ``before_step`` of a rank that hangs at ``at_step``
    (``data``: the workload's data set, wrapped, for ``data_loading``)."""
    side = dist.new_group(backend="gloo") if params.hang_in.endswith("_collective") else None

    def before_step(step: int) -> None:
        if params.hang_in == "data_loading":
            if data is not None and step == params.at_step - 1:
                data.armed = True  # the next batch, the one of at_step, never comes
            return
        if step != params.at_step:
            return
        if params.hang_in == "python":
            threading.Event().wait()  # a deadlock, as a stuck collective looks from outside
        elif params.hang_in == "other_collective":
            dist.broadcast(torch.ones(8), src=0, group=side)
        else:  # skip_collective: on with the step's work and into its all-reduce
            time.sleep(SKIP_WORK_S)

    return before_step


def others_at_step(params: FailParams) -> Callable[[int], None] | None:
    """What the ranks that do not hang do at ``at_step``: the collective kinds all-reduce on the
    group their hanging rank leaves (made here too: group creation is collective)."""
    if not params.hang_in.endswith("_collective"):
        return None
    side = dist.new_group(backend="gloo")

    def before_step(step: int) -> None:
        if step == params.at_step:
            dist.all_reduce(torch.ones(8), group=side)

    return before_step
