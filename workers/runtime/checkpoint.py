"""Checkpoints with torch.distributed.checkpoint: model, optimizer, every rank's RNG state and
the step, written so that a crash mid-save leaves the last good checkpoint usable (written to a
hidden directory, published by one rename once every rank has finished).

The directory (TORCHYARD_CHECKPOINT_DIR) is the run's, shared by its attempts: a new attempt
resumes from the newest complete checkpoint in it."""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from workers.runtime.strategies.base import Strategy

COMPLETE = "COMPLETE"  # written last into a checkpoint: without it, it does not exist
KEEP = 2  # complete checkpoints kept; older ones are removed
_NAME = re.compile(r"^step-(\d+)$")


def directory() -> Path | None:
    path = os.environ.get("TORCHYARD_CHECKPOINT_DIR")
    return Path(path) if path else None


def latest(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root``: (step, path)."""
    found = []
    for entry in root.glob("step-*") if root.is_dir() else []:
        match = _NAME.match(entry.name)
        if match and (entry / COMPLETE).exists():
            found.append((int(match.group(1)), entry))
    return max(found) if found else None


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def save(root: Path, step: int, strategy: Strategy) -> Path:
    """Collective: every rank calls it at the same step."""
    rank = dist.get_rank()
    staging, final = root / f".step-{step}.partial", root / f"step-{step}"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a save that died half way
        staging.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(strategy.model, strategy.optimizer)  # type: ignore[arg-type]
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=staging)
    torch.save({"step": step, "rng": _rng_state()}, staging / f"rank-{rank}.pt")
    dist.barrier()  # every rank's part is on disk
    if rank == 0:
        (staging / COMPLETE).write_text(str(step))
        os.replace(staging, final)  # the moment the checkpoint exists
        for _step, old in sorted(_complete(root))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _complete(root: Path) -> list[tuple[int, Path]]:
    return [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _NAME.match(p.name)) and (p / COMPLETE).exists()]


def load(path: Path, strategy: Strategy) -> int:
    """Restores the strategy's model and optimizer and this rank's RNG; returns the step."""
    model_state, optim_state = get_state_dict(strategy.model, strategy.optimizer)  # type: ignore[arg-type]
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(strategy.model, strategy.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])  # type: ignore[arg-type]
    extra = torch.load(path / f"rank-{dist.get_rank()}.pt", weights_only=False)
    random.setstate(extra["rng"]["python"])
    np.random.set_state(extra["rng"]["numpy"])
    torch.set_rng_state(extra["rng"]["torch"])
    return int(extra["step"])
