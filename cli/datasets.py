"""``torchyard dataset`` (``create``, ``list``, ``show``, ``delete``). ``create``: files → shards →
the api, one shard at a time.

Each shard is written to a temporary folder, uploaded (streamed, with its sha256 for the api to
check) and deleted before the next one is written, so the client's disk never holds more than one
shard, whatever the dataset's size; the api indexes each as it arrives. Progress (input bytes
written and uploaded) goes to stderr: one rewritten line on a terminal, a line every few seconds in
a log."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import click
import httpx

from cli.client import Api, describe_error, with_api
from torchyard import datasets as fmt
from torchyard.units import fmt_bytes

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


@click.group()
def dataset() -> None:
    """Datasets runs read by name (`"data": {"dataset": NAME}` in a run spec)."""


@dataset.command("create")
@click.argument("name")
@click.option(
    "--from",
    "sources",
    multiple=True,
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="a folder (every file under it) or a file; repeatable. Files named KEY.FIELD (0001.txt, 0001.cls): "
    "the files of one KEY are one sample",
)
@click.option(
    "--shard-bytes",
    type=click.IntRange(1 << 16, None),
    default=64 * 2**20,
    show_default=True,
    help="start a new shard before one passes this size",
)
@with_api
def dataset_create(
    name: str, sources: tuple[Path, ...], shard_bytes: int, api_url: str | None, token: str | None
) -> None:
    """Write NAME's shards from the files of --from and upload them one by one (one shard on this
    disk at a time), then register it: progress on stderr."""
    create(Api(api_url, token), name, list(sources), shard_bytes)


@dataset.command("list")
@with_api
def dataset_list(api_url: str | None, token: str | None) -> None:
    """List the datasets."""
    listed = Api(api_url, token).call("GET", "/api/v1/datasets")
    click.echo(f"{'NAME':<24} {'STATUS':<10} {'SAMPLES':>12} {'SHARDS':>6} {'SIZE':>10}  FIELDS")
    for d in listed:
        fields = ", ".join(d["schema"])
        click.echo(
            f"{d['name']:<24} {d['status']:<10} {d['samples']:>12,} {d['shards']:>6} {fmt_bytes(d['bytes']):>10}  {fields}"
        )


@dataset.command("show")
@click.argument("name")
@with_api
def dataset_show(name: str, api_url: str | None, token: str | None) -> None:
    """A dataset's fields and shards (with their sha256) as JSON."""
    click.echo(json.dumps(Api(api_url, token).call("GET", f"/api/v1/datasets/{name}"), indent=2))


@dataset.command("delete")
@click.argument("name")
@with_api
def dataset_delete(name: str, api_url: str | None, token: str | None) -> None:
    """Delete a dataset and its shards (refused while a run that has not ended reads it)."""
    Api(api_url, token).call("DELETE", f"/api/v1/datasets/{name}")
    click.echo(f"dataset {name} deleted")
