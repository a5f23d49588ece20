"""Datasets for tests and benchmarks: sample files as a user would have them, and a dataset made
from them the way ``torchyard dataset create`` makes it (the CLI's own code, against a live api)."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cli.client import Api
from cli.datasets import create

if TYPE_CHECKING:  # the benchmarks import this module without a stack
    from testkit.stack import Client


def classification_files(folder: Path, count: int, input_dim: int = 8, classes: int = 4, seed: int = 0) -> Path:
    """``count`` samples for the mlp: ``NNNNNN.input.npy`` (float32 vector) and ``NNNNNN.cls``. A
    sample's class is its number mod ``classes`` and its vector starts with its number, so a test
    can tell every sample apart."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        x = rng.standard_normal(input_dim).astype(np.float32)
        x[0] = i
        buf = io.BytesIO()
        np.save(buf, x)
        (folder / f"{i:06d}.input.npy").write_bytes(buf.getvalue())
        (folder / f"{i:06d}.cls").write_text(str(i % classes))
    return folder


def text_files(folder: Path, count: int, size: int = 100) -> Path:
    """``count`` samples with one ``txt`` field of ``size`` bytes each, saying their own number."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{i:06d}.txt").write_text(f"sample {i} ".ljust(size, "."))
    return folder


def make_dataset(url: str, token: str, name: str, sources: list[Path], shard_bytes: int) -> None:
    """Shards from ``sources`` uploaded to the api at ``url``, and the dataset completed."""
    create(Api(url, token), name, sources, shard_bytes)


def check_read_once(client: Client, run_id: int, samples: int, batch: int, ranks: int = 2, epochs: int = 2) -> None:
    """A script run's ``read EPOCH STEP RANK N N ...`` lines (one a rank and step, ``batch`` sample
    numbers each): every rank took the same steps each epoch, and read every sample they hold once."""
    steps = samples // (batch * ranks)
    reads = [line.split() for line in client.log_lines(run_id, "read ", ranks * epochs * steps)]
    assert len(reads) == ranks * epochs * steps, "each rank the same number of steps, each epoch"
    for epoch in map(str, range(epochs)):
        counted = Counter(n for line in reads if line[1] == epoch for n in line[4:])
        assert len(counted) == steps * batch * ranks and max(counted.values()) == 1, (
            f"epoch {epoch}: {counted.most_common(3)}"
        )
