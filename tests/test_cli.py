"""The CLI against an api with no worker at all: what a newcomer sees before starting one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from testkit.stack import api_only_stack

pytestmark = [pytest.mark.stack, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    with api_only_stack(tmp_path_factory.mktemp("cli")) as running:
        yield running.url, running.token


def test_submit_follow_with_no_worker_says_at_once_why_the_run_waits(api: tuple[str, str]) -> None:
    url, token = api
    command = [
        sys.executable,
        "-m",
        "cli.main",
        "submit",
        "--steps",
        "5",
        "--follow",
        "--api-url",
        url,
        "--token",
        token,
    ]
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith("run 1 queued: mlp-ddp")
        waits = "no worker node has registered yet: the run starts when one does (`torchyard worker`)"
        assert proc.stderr.readline().strip() == f"warning: {waits}"
        assert proc.stderr.readline().strip() == f"--- queued: waiting: {waits}"
        said_after = time.monotonic() - started
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"the reason came {said_after:.1f} s after the command started")
    assert said_after < 10, "at once: the CLI's start-up and one request, not the scheduler's next word"
