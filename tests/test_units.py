"""Small pieces with no processes: downsampling keeps spikes, every CLI command explains
itself, the spec quotes bad values."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from backend.metrics import downsample
from tests.conftest import run_spec
from torchyard.cli import main
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


@pytest.mark.parametrize(
    "command",
    [
        "up",
        "api",
        "worker",
        "ingest",
        "scheduler",
        "migrate",
        "submit",
        "runs",
        "logs",
        "cancel",
        "token/create",
        "token/list",
        "token/revoke",
    ],
)
def test_every_cli_command_has_help(command: str) -> None:
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
    from workers.runtime.profiling import length, merged, uncovered

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
