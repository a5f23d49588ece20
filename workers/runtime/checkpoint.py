"""Checkpoints with torch.distributed.checkpoint: model, optimizer, every rank's RNG state, the
step and the data position (a registered dataset's epoch and cursor), written so that a crash mid-save leaves the last good checkpoint usable (written to a
hidden directory, published by one rename once every rank has finished).

The directory (TORCHYARD_CHECKPOINT_DIR) is the run's, shared by its attempts: a new attempt
resumes from the newest complete checkpoint in it."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchyard import checkpoints as layout
from workers.runtime.strategies.base import Strategy

KEEP = 2  # complete checkpoints kept; older ones are removed


def directory() -> Path | None:
    path = os.environ.get("TORCHYARD_CHECKPOINT_DIR")
    return Path(path) if path else None


def latest(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root``: (step, path)."""
    found = layout.complete(root)
    return found[-1] if found else None


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # dropout on the GPU draws from the device's own generator
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's current device
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


DATA_POSITION = "data.json"  # the run's data position after the step (torchyard.data.Loader.state_dict)


def dcp() -> Any:
    """torch.distributed.checkpoint, imported by the first save or load: it brings DTensor and
    sympy, about half a second of every rank's start-up here, which a run that never checkpoints
    need not pay (most runs; every test run that does not resume)."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


def save(root: Path, step: int, strategy: Strategy, data_position: dict[str, Any] | None = None) -> Path:
    """Collective: every rank calls it at the same step. ``data_position`` (the same on every rank:
    it is global) is written once, by rank 0."""
    rank = dist.get_rank()
    staging, final = layout.staging_dir(root, step), layout.step_dir(root, step)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a save that died half way
        staging.mkdir(parents=True)
    dist.barrier()
    dcp().save(strategy.state_dict(), checkpoint_id=staging)
    torch.save({"step": step, "rng": _rng_state()}, staging / f"rank-{rank}.pt")
    if rank == 0 and data_position is not None:
        (staging / DATA_POSITION).write_text(json.dumps(data_position))
    dist.barrier()  # every rank's part is on disk
    if rank == 0:
        (staging / layout.COMPLETE).write_text(str(step))
        os.replace(staging, final)  # the moment the checkpoint exists
        for _step, old in layout.complete(root)[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(path: Path, strategy: Strategy) -> tuple[int, dict[str, Any] | None]:
    """Restores the strategy's model and optimizer and this rank's RNG; returns the step and the
    data position saved with it (None: the run reads no registered dataset)."""
    state = strategy.state_dict()
    dcp().load(state, checkpoint_id=path)
    strategy.load_state_dict(state)
    mine = path / f"rank-{dist.get_rank()}.pt"
    # A rank the saving attempt did not have (the world grew) takes rank 0's step and RNG state.
    extra = torch.load(mine if mine.exists() else path / "rank-0.pt", weights_only=False)
    _set_rng_state(extra["rng"])
    saved = path / DATA_POSITION
    return int(extra["step"]), json.loads(saved.read_text()) if saved.exists() else None
