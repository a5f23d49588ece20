"""The api's client for the ``torchyard`` command: credentials (and the ``--api-url``/``--token``
options that give them), error messages that say what is wrong, a run's live stream followed to its
end, downloads that show progress and never leave a partial file."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
import httpx

from cli import sse
from torchyard.settings import Settings, get_settings
from torchyard.states import TERMINAL

BUSY_RETRIES = 5  # times a 503 with Retry-After (a busy database) is sent again before it is shown


class Api:
    """The api at ``url`` (or TORCHYARD_API_URL, or the saved credentials) as ``token``."""

    def __init__(self, url: str | None, token: str | None) -> None:
        settings = get_settings()
        saved = _saved_credentials(settings)
        self.url = (
            url or (settings.api_url if "TORCHYARD_API_URL" in os.environ else saved.get("api_url")) or settings.api_url
        ).rstrip("/")
        self.token = token or settings.token or saved.get("token", "")
        self.client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        for attempt in range(BUSY_RETRIES + 1):
            try:
                response = self.client.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                raise click.ClickException(f"cannot reach the api at {self.url}: {exc}") from exc
            # 503 + Retry-After: the database was busy and nothing was changed, so the request is sent again.
            retry_after = response.headers.get("Retry-After", "")
            if response.status_code != 503 or not retry_after.isdigit() or attempt == BUSY_RETRIES:
                break
            time.sleep(min(int(retry_after), 10))
        if response.status_code >= 400:
            raise click.ClickException(f"{response.status_code}: {describe_error(response)}")
        return response.json() if response.content else None


api_options = [
    click.option("--api-url", default=None, help="api address (TORCHYARD_API_URL)"),
    click.option("--token", default=None, help="bearer token (TORCHYARD_TOKEN)"),
]


def with_api(fn: Any) -> Any:
    """A command's ``--api-url`` and ``--token`` options: what ``Api(api_url, token)`` takes."""
    for option in reversed(api_options):
        fn = option(fn)
    return fn


def _saved_credentials(settings: Settings) -> dict[str, str]:
    path = settings.state_dir / "credentials.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def describe_error(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        return response.text
    if isinstance(detail, list):  # validation errors: name each field and its value
        return "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', []) if p != 'body')}: {e.get('msg')} (got {e.get('input')!r})"
            for e in detail
        )
    return str(detail)


def format_line(rank: int, text: str) -> str:
    return f"[{'agent' if rank < 0 else f'rank {rank}'}] {text}"


def follow_run(client: Api, run_id: int, rank: int | None = None) -> int:
    """Streams the run's log lines and state changes until it ends, resuming by Last-Event-ID if
    the connection drops; exit code 0 if the run succeeded. Where the run stands is said at once:
    a queued run's stream may stay silent for long (no worker yet, a full cluster)."""
    run = client.call("GET", f"/api/v1/runs/{run_id}")
    if run["status"] not in TERMINAL:  # an ended run's stream ends with its final state anyway
        click.echo(f"--- {run['status']}" + (f": {run['status_reason']}" if run["status_reason"] else ""), err=True)
    last_id, retries = "0-0", 0
    while True:
        try:
            with client.client.stream(
                "GET",
                f"/api/v1/runs/{run_id}/stream",
                headers={"Last-Event-ID": last_id},
                timeout=httpx.Timeout(30, read=None),
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise click.ClickException(f"{response.status_code}: {describe_error(response)}")
                for event in sse.parse(response.iter_lines()):
                    last_id, retries = event.id, 0
                    if event.event == "logs":
                        for line_rank, _ts, text in event.data["lines"]:
                            if rank is None or rank == line_rank:
                                click.echo(format_line(line_rank, text))
                    elif event.event == "state":
                        reason = event.data.get("reason")
                        click.echo(f"--- {event.data['status']}" + (f": {reason}" if reason else ""), err=True)
            status = client.call("GET", f"/api/v1/runs/{run_id}")["status"]
            if status in TERMINAL:  # the server ends the stream after the final state
                return 0 if status == "succeeded" else 1
        except httpx.HTTPError as exc:
            retries += 1
            if retries > 30:
                raise click.ClickException(f"lost the stream of run {run_id}: {exc}") from exc
            time.sleep(min(5.0, 0.2 * retries))  # the api may be restarting: resume where we were


def download(client: Api, path: str, output: Path) -> None:
    """Streams to OUTPUT.part, then renames it: OUTPUT is never a partial file. Progress on stderr."""
    partial = output.with_name(output.name + ".part")
    tty = sys.stderr.isatty()
    try:
        with client.client.stream("GET", path, timeout=httpx.Timeout(30, read=300)) as response:
            if response.status_code >= 400:
                response.read()
                raise click.ClickException(f"{response.status_code}: {describe_error(response)}")
            total = int(response.headers.get("content-length", 0)) or None
            done, shown = 0, 0.0
            with partial.open("wb") as out:
                for chunk in response.iter_bytes(1 << 20):
                    out.write(chunk)
                    done += len(chunk)
                    if time.monotonic() - shown >= (0.2 if tty else 2.0):
                        shown = time.monotonic()
                        progress(done, total, tty)
            progress(done, total, tty, last=True)
    except httpx.HTTPError as exc:
        partial.unlink(missing_ok=True)
        raise click.ClickException(f"download from {client.url} failed: {exc}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(output)
    click.echo(f"wrote {output} ({done:,} bytes)")


def progress(done: int, total: int | None, tty: bool, last: bool = False) -> None:
    of = f" of {total:,} ({100 * done / total:.0f}%)" if total else ""
    start = "\r" if tty else ""  # a terminal: one line, rewritten; a log: a line each time
    click.echo(f"{start}{done:,} bytes{of}", err=True, nl=last or not tty)
