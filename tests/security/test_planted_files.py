"""What a run plants where it can write never makes the platform read or serve anything else:
a link swapped in for a checkpoint file while the api archives it, a linked step directory, a FIFO,
and, in the worker, an error file that is huge, a FIFO or a link to ``/dev/zero``.

The race is run as it was found: another process keeps replacing a checkpoint file with a link to
a secret (atomic renames, as fast as it can), while the checkpoint is downloaded 1,000 times; not
one archive may carry a byte of the secret. On code that checks a path and then opens it, this
leaked in about 1 of 20 downloads."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from backend import checkpoints, runs
from testkit.stack import run_spec
from torchyard import checkpoints as layout
from torchyard.settings import Settings
from torchyard.spec import RunSpec
from workers import failure

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]
SECRET = b"admin-token-that-must-never-leave-" * 4
OWN = b"the run's own tensor bytes " * 4
TRIES = 1000

# Another process, as a run's script would: make a link to the secret and a copy of its own file
# beside the target, and rename each over it in turn, forever (until killed).
SWAPPER = """
import os, sys
step, secret = sys.argv[1], sys.argv[2]
own = open(os.path.join(step, "model.pt"), "rb").read()
target, link, copy = (os.path.join(step, n) for n in ("model.pt", ".link", ".copy"))
print("ready", flush=True)
while True:
    for name in (link, copy):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
    os.symlink(secret, link)
    os.rename(link, target)
    with open(copy, "wb") as f:
        f.write(own)
    os.rename(copy, target)
"""


@pytest.fixture
def checkpoint(tmp_path: Path, session: Session) -> tuple[Settings, int, Path]:
    """A run with one complete checkpoint at step 10 (a file and a nested one), and a secret beside
    the checkpoint root, as the state dir's credentials are."""
    settings = Settings(state_dir=tmp_path / "state")
    (settings.state_dir / "credentials.json").parent.mkdir(parents=True)
    (settings.state_dir / "credentials.json").write_bytes(SECRET)
    run = runs.create_run(session, RunSpec.model_validate(run_spec()), None)
    session.commit()
    step = layout.step_dir(checkpoints.run_root(settings, run.id), 10)
    (step / "nested").mkdir(parents=True)
    (step / "model.pt").write_bytes(OWN)
    (step / "nested" / "optim.pt").write_bytes(OWN)
    (step / layout.COMPLETE).write_text("10")
    return settings, run.id, step


def download(session: Session, settings: Settings, run_id: int) -> dict[str, bytes]:
    archive = checkpoints.Archive(checkpoints.get_checkpoint(session, settings, run_id, 10))
    body = b"".join(archive)
    assert len(body) == archive.length, "the archive is exactly as long as announced"
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_a_link_swapped_in_during_downloads_never_serves_the_secret(
    session: Session, checkpoint: tuple[Settings, int, Path]
) -> None:
    settings, run_id, step = checkpoint
    swapper = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(step), str(settings.state_dir / "credentials.json")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert swapper.stdout is not None and swapper.stdout.readline().strip() == "ready"
        for _ in range(TRIES):
            files = download(session, settings, run_id)
            assert all(SECRET[:20] not in data for data in files.values()), files.keys()
            assert files["step-10/nested/optim.pt"] == OWN  # the rest of the checkpoint is whole
            if "step-10/model.pt" in files:  # the run's file when it was a file as opened, else left out
                assert files["step-10/model.pt"] == OWN
        assert swapper.poll() is None, "the swapper ran through every download"
    finally:
        swapper.kill()
        swapper.wait()


def test_a_linked_step_directory_or_file_is_not_served(
    session: Session, checkpoint: tuple[Settings, int, Path]
) -> None:
    settings, run_id, step = checkpoint
    (step / "model.pt").unlink()
    (step / "model.pt").symlink_to(settings.state_dir / "credentials.json")
    (step / "state").symlink_to(settings.state_dir, target_is_directory=True)
    os.mkfifo(step / "pipe")  # would block a reader that opens it as a file
    files = download(session, settings, run_id)
    assert sorted(files) == ["step-10/COMPLETE", "step-10/nested/optim.pt"]
    listed = checkpoints.list_checkpoints(session, settings, run_id)
    assert [(c.step, c.files) for c in listed] == [(10, 2)]
    # The whole step directory swapped for a link to the state dir: not a checkpoint at all.
    real = step.with_name(".real")
    step.rename(real)
    step.symlink_to(settings.state_dir, target_is_directory=True)
    assert checkpoints.list_checkpoints(session, settings, run_id) == []


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    """torchrun's log dir of a share whose local rank 0 failed: its error file is what each test plants."""
    rank = tmp_path / "torchrun-logs" / "run_x" / "attempt_0" / "0"
    rank.mkdir(parents=True)
    return tmp_path / "torchrun-logs"


def error_file(log_dir: Path) -> Path:
    return log_dir / "run_x" / "attempt_0" / "0" / "error.json"


@pytest.mark.parametrize("planted", ["sparse 1 GiB", "fifo", "link to /dev/zero", "link to a secret"])
def test_a_planted_error_file_leaves_the_reason_readable_and_memory_flat(
    log_dir: Path, tmp_path: Path, planted: str
) -> None:
    path = error_file(log_dir)
    if planted == "sparse 1 GiB":
        with path.open("wb") as f:
            f.truncate(1 << 30)
    elif planted == "fifo":
        os.mkfifo(path)
    elif planted == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        (tmp_path / "secret.json").write_text('{"message": "ValueError: the platform secret"}')
        path.symlink_to(tmp_path / "secret.json")
    tracemalloc.start()
    printed = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "RuntimeError: own"]
    reason = failure.describe(1, log_dir, [], printed, [], [])
    assert reason.startswith("Traceback"), reason  # the printed traceback: the planted file was passed over
    assert "RuntimeError: own" in reason and "secret" not in reason
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50 << 20, f"the worker allocated {peak} bytes reading it: no more than the error file's bound"


def test_a_genuine_error_file_is_still_read(log_dir: Path) -> None:
    error_file(log_dir).write_text('{"message": {"message": "ValueError: bad shard 7", "extraInfo": {"rank": "3"}}}')
    reason = failure.describe(1, log_dir, [], [], [], [])
    assert reason.splitlines()[:2] == ["ValueError: bad shard 7", "on rank 3"]


@pytest.fixture(autouse=True)
def _no_leaked_descriptors() -> Iterator[None]:
    """Every directory and file the readers opened is closed again, whatever they met."""
    before = len(os.listdir("/proc/self/fd"))
    yield
    assert len(os.listdir("/proc/self/fd")) <= before
