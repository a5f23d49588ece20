"""The chaos suite once per scenario (``testkit/chaos.py``), on one stack of real processes.
``python -m benchmarks.chaos --repeat N`` repeats it and prints pass counts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.chaos import SCENARIOS, Chaos
from testkit.stack import sqlite_stack

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    with sqlite_stack(tmp_path_factory.mktemp("chaos")) as running:
        yield Chaos(running)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_chaos(chaos: Chaos, scenario: str) -> None:
    SCENARIOS[scenario](chaos)
