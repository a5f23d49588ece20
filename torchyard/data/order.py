"""The global order of an epoch (seed, epoch → shards shuffled, then windows of positions), where
reading stands in it, and which positions each rank takes: ``torchyard.data``'s docstring says why."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

WINDOWS_KEPT = 8  # shuffled windows a process keeps computed


class Order:
    """Epoch ``epoch``'s order of a dataset whose shards hold ``counts`` samples: which global
    sample is at each position. Needs O(shards + shuffle_buffer) memory, never O(samples).
    ``starts``: each shard's first global number, when not the sums of ``counts`` (a shard left
    out has a count of 0 and the others keep their numbers)."""

    def __init__(
        self, counts: list[int], seed: int, epoch: int, shuffle_buffer: int, starts: np.ndarray | None = None
    ) -> None:
        self.seed, self.epoch, self.window = seed, epoch, shuffle_buffer
        sizes = np.asarray(counts, dtype=np.int64)
        self.samples = int(sizes.sum())
        # shard -> its first sample
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if starts is None else starts
        shuffled = shuffle_buffer > 0
        self.shards = (
            np.random.default_rng([seed, epoch]).permutation(len(counts)) if shuffled else np.arange(len(counts))
        )
        self.offsets = np.concatenate([[0], np.cumsum(sizes[self.shards])]).astype(np.int64)  # in shard order
        self._windows: OrderedDict[int, np.ndarray] = OrderedDict()

    def sample_at(self, positions: np.ndarray) -> np.ndarray:
        """The global sample numbers at ``positions`` (each in [0, samples))."""
        positions = np.asarray(positions, dtype=np.int64)
        placed = positions.copy()
        if self.window > 1:
            for w in np.unique(positions // self.window):
                mask = positions // self.window == w
                base = int(w) * self.window
                placed[mask] = base + self._window(int(w))[positions[mask] - base]
        k = np.searchsorted(self.offsets, placed, side="right") - 1
        return self.starts[self.shards[k]] + (placed - self.offsets[k])

    def _window(self, w: int) -> np.ndarray:
        if w not in self._windows:
            size = min(self.window, self.samples - w * self.window)
            self._windows[w] = np.random.default_rng([self.seed, self.epoch, w, 1]).permutation(size)
            while len(self._windows) > WINDOWS_KEPT:
                self._windows.popitem(last=False)
        self._windows.move_to_end(w)
        return self._windows[w]


@dataclass
class Position:
    """Where reading stands: epoch, and the positions of its order the ranks together consumed."""

    epoch: int = 0
    cursor: int = 0


def steps_left(samples: int, cursor: int, global_batch: int) -> int:
    """Steps the ranks all take in the rest of an epoch (the tail that fills no global batch is skipped)."""
    return max(0, (samples - cursor) // global_batch)


def rank_positions(cursor: int, step: int, batch: int, rank: int, world: int) -> np.ndarray:
    """The positions rank ``rank`` of ``world`` reads in the ``step``-th step after ``cursor``."""
    first = cursor + step * batch * world + rank
    return first + world * np.arange(batch, dtype=np.int64)
