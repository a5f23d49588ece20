"""An unmodified script's hang is diagnosed like a built-in workload's: the instrumentation every
script run gets (``workers/inject``) starts the dump thread, so its ranks answer with their Flight
Recorder and stacks. Two real Gloo ranks under torchrun, asked as a worker asks them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from backend.diagnosis import analyze
from testkit.hangs import hung_dumps

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

# DDP over a data set whose source stops answering on rank 1 at its fourth batch.
STALLING_LOADER = """
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, index):
        if dist.get_rank() == 1 and index >= 3 * 8:
            while True: time.sleep(1)  # a data source that stopped answering
        return torch.randn(10), torch.randn(5)


dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(10, 5))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(Samples(), batch_size=8):
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
"""


def test_an_unmodified_scripts_rank_stuck_in_its_data_loader_is_named(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(STALLING_LOADER))
    spec = {"name": "script-hang", "resources": {"procs_per_node": 2}}
    dumps = hung_dumps(tmp_path, spec, script)
    diagnosis = analyze(dumps, 2)
    head = diagnosis["headline"]
    assert head.startswith("rank 1 never entered all_reduce #") and "that rank 0 waits in" in head, head
    assert "rank 1 is at train.py:" in head and "in __getitem__ (while True: time.sleep(1)" in head, head
    assert [f["func"] for f in diagnosis["ranks"][1]["frames"]][:1] == ["<module>"]
