"""Reading a dataset (``torchyard/data.py``) in one process: the global order, each rank's stride of
it, loader processes, exact resume at another world size, and shards that are missing or corrupt.
(Real ranks under torchrun: ``tests/test_data_dist.py``.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from testkit.datasets import classification_files, text_files
from torchyard import data
from torchyard import datasets as fmt

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """101 samples in shards of uneven sizes (the last one short)."""
    tmp = tmp_path_factory.mktemp("uneven")
    folder = tmp / "set"
    fmt.write_dataset(folder, "uneven", [text_files(tmp / "files", 101, size=700)], shard_bytes=12 * 1024)
    return folder


def numbers(batches: list[list[dict]]) -> list[int]:
    return [s["__index__"] for batch in batches for s in batch]


def test_an_epochs_order_is_a_permutation_fixed_by_seed_and_epoch() -> None:
    counts = [7, 3, 11, 1, 9]
    for window in (0, 1, 4, 16, 1000):
        order = data.Order(counts, seed=5, epoch=2, shuffle_buffer=window)
        placed = order.sample_at(np.arange(31))
        assert sorted(placed.tolist()) == list(range(31)), window
        again = data.Order(counts, seed=5, epoch=2, shuffle_buffer=window).sample_at(np.arange(31)[::-1])
        assert again.tolist() == placed[::-1].tolist()  # any positions, in any order, give the same answer
    assert data.Order(counts, 5, 2, 0).sample_at(np.arange(31)).tolist() == list(range(31))  # 0: stored order
    epochs = {tuple(data.Order(counts, 5, e, 16).sample_at(np.arange(31)).tolist()) for e in range(4)}
    assert len(epochs) == 4, "each epoch is shuffled anew"
    seeds = {tuple(data.Order(counts, s, 0, 16).sample_at(np.arange(31)).tolist()) for s in range(4)}
    assert len(seeds) == 4


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 2), (4, 2), (3, 1)])
def test_every_sample_once_per_epoch_across_ranks_and_loader_processes(uneven: Path, world: int, workers: int) -> None:
    batch = 5
    loaders = [data.Loader(uneven, batch, r, world, seed=1, shuffle_buffer=16, workers=workers) for r in range(world)]
    steps = 101 // (batch * world)
    for epoch in range(2):
        seen = [numbers(list(loader)) for loader in loaders]
        assert [len(s) for s in seen] == [steps * batch] * world, "every rank takes the same number of steps"
        together = Counter(n for s in seen for n in s)
        assert max(together.values()) == 1 and len(together) == steps * batch * world
        assert all(loader.position == data.Position(epoch + 1, 0) for loader in loaders)


def test_a_resumed_epoch_goes_on_with_the_next_unseen_sample_at_another_world_size(uneven: Path) -> None:
    batch, before, after = 3, 4, 2
    first = [data.Loader(uneven, batch, r, before, seed=7, shuffle_buffer=10, workers=0) for r in range(before)]
    seen: list[int] = []
    saved = None
    for loader in first:
        epoch = iter(loader)
        seen += numbers([next(epoch) for _ in range(5)])  # five steps each, then the node is lost
        saved = saved or loader.state_dict()
        assert loader.state_dict() == saved, "the data position is global: every rank saves the same"
    assert saved is not None and (saved["epoch"], saved["cursor"]) == (0, 5 * batch * before)
    second = [data.Loader(uneven, batch, r, after, seed=99, workers=2) for r in range(after)]
    for loader in second:
        loader.load_state_dict(saved)  # its seed and shuffle come with it
        seen += numbers(list(loader))
    counted = Counter(seen)
    assert max(counted.values()) == 1, "no sample twice in the epoch"
    assert len(counted) == 60 + (101 - 60) // (batch * after) * batch * after, "every sample but the short tail"
    uninterrupted = numbers(list(data.Loader(uneven, batch * before, 0, 1, seed=7, shuffle_buffer=10, workers=0)))
    assert set(counted) == set(uninterrupted[: len(counted)]), "the same order as had the node stayed"


def test_a_position_of_another_content_is_refused(uneven: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    fmt.write_dataset(other, "uneven", [text_files(tmp_path / "files", 12)])
    state = data.Loader(other, 2, workers=0).state_dict()
    with pytest.raises(ValueError, match="not of 'uneven' as it is now"):
        data.Loader(uneven, 2, workers=0).load_state_dict(state)


def test_a_missing_or_corrupt_shard_fails_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "set"
    fmt.write_dataset(folder, "fragile", [text_files(tmp_path / "files", 40, size=1000)], shard_bytes=8192)
    shard = folder / fmt.shard_file(2)
    original = shard.read_bytes()
    raw = bytearray(original)
    raw[1100] ^= 0xFF  # inside the first member's data: the size stays the same
    shard.write_bytes(bytes(raw))
    for workers in (0, 2):
        with pytest.raises(data.ShardError) as caught:
            for _ in data.Loader(folder, 4, workers=workers, shuffle_buffer=0):
                pass
        message = str(caught.value)
        assert message.startswith("dataset 'fragile': shard shard-000002.tar is corrupt: sample "), message
        assert "fails its CRC-32 check" in message and "Original Traceback" not in message
    shard.write_bytes(original[:-512])
    with pytest.raises(data.ShardError, match=r"shard shard-000002\.tar is corrupt: [\d,]+ bytes, the manifest says"):
        data.Loader(folder, 4)
    shard.unlink()
    with pytest.raises(data.ShardError, match=r"dataset 'fragile': shard shard-000002\.tar is missing"):
        data.Loader(folder, 4)


def test_with_on_bad_shard_skip_bad_shards_are_skipped_and_counted(tmp_path: Path) -> None:
    """A shard missing at the start is left out of the order on every rank alike; a sample failing
    its CRC-32 is left out of its batch, the batch's readable samples repeated in its place."""
    folder = tmp_path / "set"
    fmt.write_dataset(folder, "fragile", [text_files(tmp_path / "files", 40, size=1000)], shard_bytes=8192)
    assert len(fmt.Manifest.read(folder).shards) == 8  # 5 samples each
    shard = folder / fmt.shard_file(2)
    raw = bytearray(shard.read_bytes())
    raw[1100] ^= 0xFF  # sample 10, the shard's first
    shard.write_bytes(bytes(raw))
    (folder / fmt.shard_file(5)).unlink()  # samples 25..29
    for workers in (0, 2):
        loaders = [
            data.Loader(folder, 4, r, 2, shuffle_buffer=0, workers=workers, on_bad_shard="skip") for r in range(2)
        ]
        assert [loader.samples for loader in loaders] == [35, 35]
        epochs = [list(loader) for loader in loaders]
        assert [len(e) for e in epochs] == [4, 4], "35 samples, 8 a step: every rank the same 4 steps"
        assert all(len(batch) == 4 for e in epochs for batch in e), "a batch keeps its size"
        # stored order without shard 5: positions 0..24 are samples 0..24, then 30..39; rank 0 takes the
        # even positions: its 2nd step is samples 8, 10, 12, 14, and 10 is unreadable
        assert [s["__index__"] for s in epochs[0][1]] == [8, 12, 14, 8]
        seen = {s["__index__"] for e in epochs for batch in e for s in batch}
        assert not seen & {10, 25, 26, 27, 28, 29} and len(seen) == 31
        assert set(loaders[0].bad) == {"shard-000005.tar", "shard-000002.tar"} and loaders[0].bad_samples == 1
        assert set(loaders[1].bad) == {"shard-000005.tar"} and loaders[1].bad_samples == 0
        assert "shard shard-000002.tar is corrupt: sample 0 field 'txt'" in loaders[0].bad["shard-000002.tar"]
        assert loaders[1].last_read == (4, 4000), "its last batch: 4 samples of 1,000 bytes"
    with pytest.raises(data.ShardError, match=r"shard shard-000005\.tar is missing"):
        data.Loader(folder, 4, on_bad_shard="fail")
    # a position saved with shard 5 left out resumes with it left out, and only so: another order
    saved = loaders[0].state_dict()
    assert saved["left_out"] == ["shard-000005.tar"], "a shard found corrupt while reading keeps its place"
    data.Loader(folder, 4, on_bad_shard="skip", workers=0).load_state_dict(saved)
    (folder / fmt.shard_file(6)).unlink()
    with pytest.raises(ValueError, match=r"taken with shards \['shard-000005.tar'\] left out .* resuming would not"):
        data.Loader(folder, 4, on_bad_shard="skip", workers=0).load_state_dict(saved)


def test_a_batch_with_no_readable_sample_repeats_the_last_good_one(tmp_path: Path) -> None:
    folder = tmp_path / "set"
    fmt.write_dataset(folder, "hollow", [text_files(tmp_path / "files", 20, size=1000)], shard_bytes=8192)
    index = folder / fmt.index_file(1)  # samples 5..9: a damaged index makes the whole shard unreadable
    index.write_bytes(index.read_bytes()[:-1] + b"x")
    loader = data.Loader(folder, 5, shuffle_buffer=0, workers=1, on_bad_shard="skip")
    batches = [[s["__index__"] for s in batch] for batch in loader]
    assert batches == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    assert loader.bad_samples == 5 and "its index fails its sha256 check" in loader.bad["shard-000001.tar"]
    first = data.Loader(folder, 5, shuffle_buffer=0, workers=0, on_bad_shard="skip")
    first.position = data.Position(0, 5)  # its first batch is the broken shard's
    with pytest.raises(data.ShardError, match="not one sample of this rank's first batch could be read"):
        next(iter(first))
    for n in range(4):
        (folder / fmt.shard_file(n)).unlink()
    with pytest.raises(ValueError, match=r"0 samples in its readable shards \(4 left out: dataset 'hollow': shard"):
        data.Loader(folder, 5, on_bad_shard="skip")


def test_samples_come_decoded_with_their_number_and_shard(tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    for i in range(6):
        (files / f"{i}.txt").write_text(f"text {i}")
        (files / f"{i}.cls").write_text(str(i % 2))
        (files / f"{i}.json").write_text(f'{{"i": {i}}}')
        np.save(files / f"{i}.x.npy", np.full(3, i, dtype=np.float32))
    folder = tmp_path / "set"
    fmt.write_dataset(folder, "mixed", [files])
    (sample,) = data.Loader(folder, 1, shuffle_buffer=0, workers=0).reader.read([4])
    assert sample["__index__"] == 4 and sample["__shard__"] == "shard-000000.tar"
    assert (sample["txt"], sample["cls"], sample["json"]) == ("text 4", 0, {"i": 4})
    assert sample["x.npy"].tolist() == [4.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="fewer than one global batch"):
        data.Loader(folder, 4, rank=0, world=2)


def test_the_builtin_workloads_read_their_fields(tmp_path: Path) -> None:
    from torchyard.spec import RunSpec
    from workers.runtime.workloads import build

    def spec(name: str, params: dict) -> RunSpec:
        return RunSpec.model_validate({"workload": {"name": name, "params": params}, "data": {"dataset": "d"}})

    folder = tmp_path / "set"
    fmt.write_dataset(folder, "prose", [text_files(tmp_path / "files", 3, size=10)])
    samples = data.Loader(folder, 3, shuffle_buffer=0, workers=0, decode=False).reader.read([0, 2], decode=False)
    charlm = build(spec("charlm", {"seq_len": 16, "d_model": 16, "n_heads": 2}))
    assert charlm.dataset is None and charlm.collate is not None, "no generated corpus"
    x, y, numbers = charlm.collate(samples)
    assert numbers.tolist() == [0, 2] and x.shape == y.shape == (2, 16)
    text = b"sample 2 ."
    assert x[1, :9].tolist() == list(text[:9]) and y[1, :9].tolist() == list(text[1:10])
    assert set(x[1, 9:].tolist()) == {0} and set(y[1, 9:].tolist()) == {-100}, "padding is ignored by the loss"

    mlp = build(spec("mlp", {"input_dim": 8, "classes": 4}))
    files = tmp_path / "vectors"
    classification_files(files, 6, input_dim=8, classes=6)  # classes 4 and 5 are out of the mlp's range
    fmt.write_dataset(tmp_path / "v", "vectors", [files])
    rows = data.Loader(tmp_path / "v", 6, shuffle_buffer=0, workers=0).reader.read(list(range(6)), decode=False)
    x, y, numbers = mlp.collate(rows[:4])
    assert x.shape == (4, 8) and x[:, 0].tolist() == [0, 1, 2, 3] and y.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"sample 4 \(shard shard-000000.tar\) has class 4: workload.params.classes"):
        mlp.collate(rows)


def test_the_reading_benchmark_measures_every_reader(tmp_path: Path) -> None:
    out = tmp_path / "data.json"
    command = [sys.executable, "-m", "benchmarks.data", "--samples", "600", "--dim", "8", "--epochs", "1"]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([*command, "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert set(figures["rows"]) == {f"shards, {n} loader processes" for n in (0, 2, 4)}
    assert all(row["samples_per_s"] > 0 and row["of_in_memory"] > 0 for row in figures["rows"].values())
