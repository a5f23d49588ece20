"""``torchyard dataset create``: files → shards → the api, one shard at a time.

Each shard is written to a temporary folder, uploaded (streamed, with its sha256 for the api to
check) and deleted before the next one is written, so the client's disk never holds more than one
shard, whatever the dataset's size; the api indexes each as it arrives. Progress (input bytes
written and uploaded) goes to stderr: one rewritten line on a terminal, a line every few seconds in
a log."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click
import httpx

from cli.client import Api, describe_error
from torchyard import datasets as fmt

UPLOAD_TIMEOUT = httpx.Timeout(30, write=600, read=600)  # the api indexes a shard before it answers


def create(api: Api, name: str, sources: list[Path], shard_bytes: int) -> None:
    try:
        samples = fmt.files_as_samples(fmt.iter_files(sources))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if not samples:
        raise click.ClickException(
            f"no files under {', '.join(map(str, sources))}: a dataset needs at least one sample (files named KEY.FIELD)"
        )
    total = sum(path.stat().st_size for _key, fields in samples for _field, path in fields)
    api.call("POST", "/api/v1/datasets", json={"name": name})
    shown = _Progress(total, len(samples))
    with tempfile.TemporaryDirectory(prefix="torchyard-shards-") as tmp:
        writer = fmt.ShardWriter(Path(tmp), shard_bytes)
        for key, fields in samples:
            closed = writer.add(key, fields)
            if closed is not None:
                _upload(api, name, writer.index - 1, closed)
            shown.sample(sum(path.stat().st_size for _field, path in fields), writer.index)
        last = writer.close()
        if last is not None:
            _upload(api, name, writer.index, last)
    shown.done(writer.index + 1)
    ready = api.call("POST", f"/api/v1/datasets/{name}/complete")
    click.echo(
        f"dataset {ready['name']} ready: {ready['samples']:,} samples in {ready['shards']} shards "
        f"({ready['bytes']:,} bytes); fields: {', '.join(ready['schema'])}"
    )


def _upload(api: Api, name: str, index: int, path: Path) -> None:
    """One shard, streamed; its local copy is removed once the api has it."""
    headers = {
        "X-Shard-SHA256": fmt.sha256_file(path),
        "Content-Type": "application/x-tar",
        "Content-Length": str(path.stat().st_size),
    }
    try:
        with path.open("rb") as body:
            response = api.client.put(
                f"/api/v1/datasets/{name}/shards/{index}", content=body, headers=headers, timeout=UPLOAD_TIMEOUT
            )
    except httpx.HTTPError as exc:
        raise click.ClickException(f"uploading shard {index} to {api.url} failed: {exc}") from exc
    if response.status_code >= 400:
        raise click.ClickException(f"shard {index}: {response.status_code}: {describe_error(response)}")
    path.unlink()


class _Progress:
    def __init__(self, total: int, samples: int) -> None:
        self.total, self.samples, self.bytes, self.count = total, samples, 0, 0
        self.tty = sys.stderr.isatty()
        self.shown = 0.0

    def sample(self, size: int, shard: int) -> None:
        self.bytes += size
        self.count += 1
        if time.monotonic() - self.shown >= (0.2 if self.tty else 2.0):
            self.shown = time.monotonic()
            self._line(shard + 1, last=False)

    def done(self, shards: int) -> None:
        self._line(shards, last=True)

    def _line(self, shards: int, last: bool) -> None:
        pct = 100 * self.bytes / self.total if self.total else 100.0
        start = "\r" if self.tty else ""
        click.echo(
            f"{start}{self.count:,}/{self.samples:,} samples, {self.bytes:,}/{self.total:,} bytes ({pct:.0f}%), "
            f"{shards} shards",
            err=True,
            nl=last or not self.tty,
        )
