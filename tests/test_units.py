"""Small pieces with no processes: downsampling keeps spikes, every CLI command explains
itself, the spec quotes bad values, a failure's reason names the first failing rank, a share's
GPUs are its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from backend.metrics import downsample
from cli.main import main
from testkit.stack import run_spec
from torchyard.settings import Settings
from torchyard.spec import RunSpec


def test_downsampling_a_million_points_keeps_the_spike_and_the_order() -> None:
    steps = np.arange(1, 1_000_001)
    values = np.sin(steps / 5000.0)
    values[654_321] = 50.0
    values[123_456] = -50.0
    kept_steps, (kept,) = downsample(steps, [values], 1000)
    assert len(kept_steps) <= 1000
    assert np.all(np.diff(kept_steps) > 0)
    assert kept.max() == 50.0 and kept.min() == -50.0
    assert 654_322 in kept_steps.tolist()


def test_short_series_are_returned_whole() -> None:
    steps = np.arange(5)
    kept_steps, (kept,) = downsample(steps, [steps * 2.0], 10)
    assert kept_steps.tolist() == [0, 1, 2, 3, 4] and kept.tolist() == [0, 2, 4, 6, 8]


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[str]:
    """Every command of the CLI, walked from its command table (a new command is in it at once)."""
    found = []
    for name, command in sorted(group.commands.items()):
        path = (*prefix, name)
        found += _commands(command, path) if isinstance(command, click.Group) else ["/".join(path)]
    return found


@pytest.mark.parametrize("command", _commands(main))
def test_every_cli_command_has_help(command: str) -> None:
    assert len(_commands(main)) >= 15  # the walk itself finds the commands
    result = CliRunner().invoke(main, [*command.split("/"), "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output and len(result.output.splitlines()) > 3


def test_spec_errors_quote_the_bad_value() -> None:
    spec = run_spec(procs=3, batch_size=64)
    with pytest.raises(ValidationError, match=r"batch_size \(64\) must be divisible by nodes × procs_per_node \(3\)"):
        RunSpec.model_validate(spec)
    small = run_spec(params={"samples": 10}, batch_size=64)
    with pytest.raises(ValidationError, match=r"samples \(10\) must be at least training.batch_size \(64\)"):
        RunSpec.model_validate(small)
    heads = run_spec(workload="charlm", params={"d_model": 30, "n_heads": 4})
    with pytest.raises(ValidationError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        RunSpec.model_validate(heads)


def test_trace_intervals_union_and_the_part_no_compute_covers() -> None:
    from workers.runtime.comm import length, merged, uncovered

    comm = merged([(10, 20), (0, 5), (15, 30), (40, 50)])
    assert comm == [(0, 5), (10, 30), (40, 50)] and length(comm) == 35
    compute = merged([(2, 12), (25, 45)])
    # exposed: 0–2, 12–25, 45–50
    assert uncovered(comm, compute) == 2 + 13 + 5
    assert uncovered(comm, []) == 35 and uncovered([], compute) == 0
    assert uncovered([(0, 10)], [(0, 10)]) == 0 and uncovered([(0, 10)], [(-5, 3), (4, 6), (9, 20)]) == 1 + 3


def test_powersgd_needs_two_warmup_steps_and_says_why() -> None:
    spec = run_spec()
    spec["strategy"] = {"kind": "ddp", "comm_hook": "powersgd", "powersgd_warmup": 1}
    with pytest.raises(ValidationError, match=r"powersgd_warmup \(1\) must be at least 2"):
        RunSpec.model_validate(spec)
    spec["strategy"] = {"kind": "ddp", "comm_hook": "allreduce", "powersgd_warmup": 0}  # no PowerSGD: no limit
    RunSpec.model_validate(spec)


def test_the_failure_reason_is_the_first_error_written_in_torchruns_last_restart_round(tmp_path: Path) -> None:
    from workers import failure

    def error_file(restart: int, local_rank: int, rank: int, message: str, line: int, mtime_ns: int) -> None:
        path = tmp_path / "logs" / "run-1_x" / f"attempt_{restart}" / str(local_rank) / "error.json"
        path.parent.mkdir(parents=True)
        stack = (
            f'Traceback (most recent call last):\n  File "{tmp_path}/code/train.py", line {line}, in step\n'
            f'    boom()\n  File "/usr/lib/python3/site-packages/torch/x.py", line 9, in boom\n    raise E\n{message}\n'
        )
        extra = {"py_callstack": stack, "timestamp": "1", "rank": str(rank)}
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
        os.utime(path, ns=(mtime_ns, mtime_ns))

    error_file(0, 0, 0, "OSError: an earlier round", 3, 1_000)  # restarted after this: not what ended it
    error_file(1, 1, 1, "ValueError: bad shard 7", 12, 2_000)
    error_file(1, 0, 0, "RuntimeError: Connection closed by peer", 40, 2_001)  # its peer's failure, after it
    agent = ["train.py FAILED", "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
             "  exitcode  : 1 (pid: 4242)"]  # fmt: skip

    reason = failure.describe(1, tmp_path / "logs", [tmp_path / "code"], [], agent, [])

    assert reason.splitlines()[:3] == [
        "ValueError: bad shard 7",
        "on rank 1 at train.py line 12, in step",  # the innermost frame of the run's own code
        "Traceback (most recent call last):",
    ]
    assert (
        reason.splitlines()[-1]
        == "torchrun: train.py FAILED (exit code 1; root cause: rank 1 (local_rank: 1), exitcode 1)"
    )
    printed = ["Traceback (most recent call last):", "ImportError: no module named shards"]
    no_file = failure.describe(-9, tmp_path / "none", [], printed, [], [])
    assert no_file.splitlines() == [*printed, "torchrun exited with killed by SIGKILL"]


def test_a_cuda_share_sees_only_its_gpus_and_a_cpu_share_none(tmp_path: Path) -> None:
    from workers.torchrun import training_env

    settings = Settings(state_dir=tmp_path, node_gpus="0,1,2,3")
    cuda = run_spec(procs=2)
    cuda["resources"]["device"] = "cuda"
    env = training_env(settings, 1, 1, cuda, tmp_path, "redis://x", [2, 3])
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert training_env(settings, 1, 1, run_spec(procs=2), tmp_path, "redis://x", [])["CUDA_VISIBLE_DEVICES"] == ""


def test_a_nodes_gpu_inventory_set_by_env_is_taken_as_given_and_a_bad_one_refused(tmp_path: Path) -> None:
    from workers import gpus

    settings = Settings(state_dir=tmp_path, node_gpus="0, 1,3")
    assert [g.index for g in gpus.inventory(settings)] == [0, 1, 3]
    assert gpus.devices(settings, gpus.inventory(settings)) == ["cpu", "cuda"]
    assert gpus.devices(Settings(state_dir=tmp_path, node_devices="cpu"), gpus.inventory(settings)) == ["cpu"]
    for bad in ("0,0", "gpu0", "-1", "1024"):
        with pytest.raises(ValidationError, match="TORCHYARD_NODE_GPUS"):
            Settings(state_dir=tmp_path, node_gpus=bad)
