"""How fast a rank reads a registered dataset from local shards, against the same samples held in
memory as a tensor data set.

    python -m benchmarks.data [--samples 20000] [--dim 256] [--batch 64] [--epochs 2] [--json out.json]
                              [--shard-bytes N] [--object-store]

Writes ``--samples`` mlp samples (``input.npy``: ``--dim`` float32, ``cls``) as shards
(``torchyard.datasets.write_dataset``, 64 MiB shards), then reads ``--epochs`` epochs of batches
of ``--batch`` through ``torchyard.data.Loader`` with 0, 2 and 4 loader processes (collated by the
mlp's own collate: decode, CRC check, stack), and the same samples from a ``TensorBatches`` through a
DataLoader with a random sampler (what a built-in workload does with generated data). Prints
samples/s and bytes/s read (the shards' bytes, tar headers included), and each loader's rate as a
fraction of the in-memory one. The first batch of each reader (process start-up) is not timed.
The page cache holds the shards after writing them: this measures the reading path, not a disk.

``--object-store``: the same shards also read from a local S3 server (moto's, ``testkit/objectstore.py``)
through a rank's view (presigned ranged GETs), shuffled and in stored order. Moto reads a whole
object for each ranged GET: keep ``--shard-bytes`` small, and take these as the reading path's
cost against a slow store, not a real store's."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from testkit.datasets import classification_files
from testkit.objectstore import MotoServer, publish
from torchyard import data
from torchyard import datasets as fmt
from torchyard.spec import RunSpec
from workers.runtime.workloads import TensorBatches, as_batch, build


def timed(batches: Any, batch: int) -> tuple[float, int]:
    """(seconds, samples) over every batch but the first."""
    iterator = iter(batches)
    next(iterator)
    start, count = time.perf_counter(), 0
    for _ in iterator:
        count += batch
    return time.perf_counter() - start, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--shard-bytes", type=int, default=fmt.DEFAULT_SHARD_BYTES)
    parser.add_argument("--object-store", action="store_true", help="also read them from a local S3 server")
    args = parser.parse_args()

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="torchyard-bench-data-") as tmp:
        files = classification_files(Path(tmp) / "files", args.samples, input_dim=args.dim)
        started = time.perf_counter()
        manifest = fmt.write_dataset(Path(tmp) / "set", "bench", [files], args.shard_bytes)
        written_s = time.perf_counter() - started
        spec = RunSpec.model_validate(
            {"workload": {"name": "mlp", "params": {"input_dim": args.dim, "classes": 4}}, "data": {"dataset": "bench"}}
        )
        collate = build(spec).collate
        readers = [(f"shards, {workers} loader processes", Path(tmp) / "set", workers, 10_000) for workers in (0, 2, 4)]
        moto = MotoServer(Path(tmp) / "moto.log").start() if args.object_store else None
        if moto is not None:
            store, _client = moto.store(Path(tmp) / "state")
            publish(store, Path(tmp) / "set", "bench")
            view = store.give("bench", Path(tmp) / "view", 3600).folder
            readers += [(f"object store, {w} loader processes", view, w, 10_000) for w in (0, 2)]
            readers += [("object store, stored order", view, 0, 0)]
        rows: dict[str, dict[str, float]] = {}
        for name, folder, workers, shuffle in readers:
            loader = data.Loader(
                folder, args.batch, workers=workers, collate=collate, decode=False, shuffle_buffer=shuffle
            )
            seconds = count = 0.0
            for _ in range(args.epochs):
                s, n = timed(loader, args.batch)
                seconds, count = seconds + s, count + n
            rows[name] = {"samples_per_s": count / seconds}
        if moto is not None:
            moto.stop()
        x = torch.randn(args.samples, args.dim)
        y = torch.randint(0, 4, (args.samples,))
        memory = TensorBatches(x, y)
        seconds = count = 0.0
        for _ in range(args.epochs):
            batches = DataLoader(
                memory, batch_size=args.batch, sampler=RandomSampler(memory), drop_last=True, collate_fn=as_batch
            )
            s, n = timed(batches, args.batch)
            seconds, count = seconds + s, count + n
        in_memory = count / seconds
    per_sample = manifest.bytes / manifest.samples
    print(
        f"{manifest.samples:,} samples of {args.dim} float32 + a class in {len(manifest.shards)} shards "
        f"({manifest.bytes:,} bytes, {per_sample:,.0f} a sample), written in {written_s:.1f} s; batch {args.batch}"
    )
    print(f"{'reader':<36} {'samples/s':>12} {'MB/s':>9} {'of in-memory':>13}")
    for name, row in rows.items():
        row["bytes_per_s"] = row["samples_per_s"] * per_sample
        row["of_in_memory"] = row["samples_per_s"] / in_memory
        print(
            f"{name:<36} {row['samples_per_s']:>12,.0f} {row['bytes_per_s'] / 1e6:>9.1f} {row['of_in_memory']:>12.1%}"
        )
    print(f"{'in-memory tensors':<36} {in_memory:>12,.0f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "in_memory_samples_per_s": in_memory}, indent=1))


if __name__ == "__main__":
    main()
