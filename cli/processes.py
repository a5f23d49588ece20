"""``torchyard up``, ``url``, ``api``, ``scheduler``, ``ingest``, ``worker``, ``migrate``: the
system's processes, each started alone (or all of them together, by ``up``)."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import click

from torchyard.settings import Settings, get_settings


def _platform_process() -> None:
    """Whatever the platform's processes create (state, bundles, records, the database) is theirs
    alone: ranks run as another user (workers/isolation.py) and get only what is handed to them."""
    os.umask(0o077)


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="the api's port (TORCHYARD_PORT, 8000)")
@click.option(
    "--redis-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="the private redis-server's port (default: a free one)",
)
@click.option("--verbose", is_flag=True, help="show the api's access log and the worker's INFO lines")
def up(port: int | None, redis_port: int | None, verbose: bool) -> None:
    """Start api, scheduler, ingest and a local worker on embedded defaults (SQLite, a private Redis
    unless TORCHYARD_REDIS_URL is set). Prints the URL and an admin token last (`torchyard url` prints
    them again); Ctrl-C says what becomes of live runs, then stops it all."""
    _platform_process()
    from cli.local import up as run_up

    settings = get_settings()
    if port:
        settings = settings.model_copy(update={"port": port})
    sys.exit(run_up(settings, redis_port=redis_port, verbose=verbose))


@click.command()
def url() -> None:
    """Print the dashboard's login link and the admin token of this machine's `torchyard up`."""
    from cli.local import credentials_file, login_link

    path = credentials_file(get_settings())
    try:
        saved = json.loads(path.read_text())
        link, token = login_link(saved["api_url"], saved["token"]), saved["token"]
    except (OSError, ValueError, KeyError) as exc:
        raise click.ClickException(f"no `torchyard up` has written {path} yet ({exc.__class__.__name__})") from exc
    click.echo(f"dashboard:   {link}\nadmin token: {token}")


@click.command()
@click.option("--host", default=None, help="bind address (TORCHYARD_HOST)")
@click.option("--port", type=int, default=None, help="port (TORCHYARD_PORT)")
@click.option(
    "--scheduler/--no-scheduler", default=True, help="run the scheduler (and the sweep controller) inside the api"
)
@click.option("--access-log/--no-access-log", default=True, help="log every request")
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", help="uvicorn's log level"
)
def api(host: str | None, port: int | None, scheduler: bool, access_log: bool, log_level: str) -> None:
    """Serve the REST api, the live stream and the front end."""
    _platform_process()
    import uvicorn

    from backend import executors as sched
    from backend import sweeper
    from backend.app import create_app

    settings = _server_settings()
    stop = threading.Event()
    if scheduler:
        threading.Thread(target=sched.serve, args=(stop,), name="scheduler", daemon=True).start()
        threading.Thread(target=sweeper.serve, args=(stop,), name="sweeper", daemon=True).start()
    try:
        uvicorn.run(
            create_app(),
            host=host or settings.host,
            port=port or settings.port,
            log_level=log_level,
            access_log=access_log,
            timeout_graceful_shutdown=5,  # live streams of running runs would hold shutdown forever
        )
    finally:
        stop.set()


@click.command()
def scheduler() -> None:
    """Run the scheduler and the sweep controller alone (one leader at a time of each holds a Redis lock)."""
    _platform_process()
    from backend import executors as sched
    from backend import sweeper

    _server_settings()

    def both(stop: threading.Event) -> None:
        threading.Thread(target=sweeper.serve, args=(stop,), name="sweeper", daemon=True).start()
        sched.serve(stop)

    _serve_until_signal(both)


@click.command()
def ingest() -> None:
    """Write the run streams (metrics, logs, reports) to the database."""
    _platform_process()
    from backend import ingest as ing

    _server_settings()
    _serve_until_signal(ing.serve)


@click.command()
@click.option("--concurrency", type=int, default=None, help="runs at once (default: TORCHYARD_NODE_SLOTS)")
@click.option(
    "--loglevel",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
    default="INFO",
    help="the worker's log level",
)
@click.option("--quiet", is_flag=True, help="without Celery's start-up banner")
def worker(concurrency: int | None, loglevel: str, quiet: bool) -> None:
    """Run this node's Celery worker: heartbeats its capacity, launches runs placed on it."""
    _platform_process()
    settings = get_settings()
    if not settings.redis_url:
        raise click.UsageError("TORCHYARD_REDIS_URL must point at the cluster's Redis")
    import warnings

    from celery.exceptions import SecurityWarning

    from torchyard.tasks import node_queue
    from workers.celery_app import app

    # Root on purpose: a root worker walls its runs off (ranks as the run user, in namespaces of
    # their own: workers/isolation.py) and says so at start; Celery's 8-line warning would say the opposite.
    warnings.filterwarnings("ignore", category=SecurityWarning)

    app.worker_main([
        *(["--quiet"] if quiet else []),  # a global option of `celery`: before the sub-command
        "worker", "--queues", node_queue(settings.node_id), "--hostname", f"{settings.node_id}@%h",
        "--concurrency", str(concurrency or settings.node_slots), "--pool", "prefork",
        "--loglevel", loglevel, "--without-gossip", "--without-mingle",
    ])  # fmt: skip


@click.command()
def migrate() -> None:
    """Upgrade the database schema to the newest migration; install TORCHYARD_ADMIN_TOKEN, or
    create an admin token (printed once) if the database has none."""
    _platform_process()
    from backend.db import transaction
    from backend.migrate import upgrade
    from backend.security import ensure_admin_token

    settings = get_settings()
    upgrade(settings.sqlalchemy_url)
    click.echo("database is at the newest schema")
    with transaction() as session:
        token = ensure_admin_token(session, settings.admin_token or None)
    if token and not settings.admin_token:
        click.echo(f"admin token (shown once): {token}")


def _server_settings() -> Settings:
    settings = get_settings()
    if not settings.redis_url:
        raise click.UsageError("TORCHYARD_REDIS_URL is not set (`torchyard up` sets it for the processes it starts)")
    return settings


def _serve_until_signal(serve: Any) -> None:
    import signal

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    serve(stop)
