"""The CLI against an api with no worker at all: what a newcomer sees before starting one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from cli.main import main as cli
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
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith("run 1 queued: mlp-ddp")
        waits = "no worker node has registered yet: the run starts when one does (`torchyard worker`)"
        assert proc.stderr.readline().strip() == f"warning: {waits}"
        assert proc.stderr.readline().strip() == f"--- queued: waiting: {waits}"
    finally:
        proc.terminate()
        proc.wait(10)
    # At once, by construction rather than by a clock: the first line after the run's is the
    # submit answer's own warning (one request), before any word the follow loop reads later.


def test_the_stall_timeout_is_an_option_of_both_submits(api: tuple[str, str], tmp_path: Path) -> None:
    url, token = api
    auth = ["--api-url", url, "--token", token]
    (tmp_path / "train.py").write_text("print('hi')\n")
    script = CliRunner().invoke(
        cli, ["submit-script", str(tmp_path), "--entry", "train.py", "--stall-timeout", "45", *auth]
    )
    builtin = CliRunner().invoke(cli, ["submit", "--steps", "5", "--stall-timeout", "0", *auth])
    unset = CliRunner().invoke(cli, ["submit", "--steps", "5", *auth])
    negative = CliRunner().invoke(cli, ["submit", "--stall-timeout", "-1", *auth])
    assert negative.exit_code == 2 and "--stall-timeout" in negative.output, negative.output
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"})
    found = []
    for made in (script, builtin, unset):
        assert made.exit_code == 0, made.output
        run_id = int(made.output.split("run ")[1].split()[0])
        found.append(http.get(f"/api/v1/runs/{run_id}").json()["spec"]["training"]["stall_timeout_s"])
    assert found == [45, 0, 0]  # unset: the spec's default, 0 (flagged by default detection, never stopped)
