"""The ``torchyard`` command: start the system's processes, and talk to its api."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import click

from torchyard.client import Api, download, follow_run, format_line
from torchyard.settings import Settings, get_settings


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """torchyard: run and watch distributed PyTorch training."""


# ---- processes ---------------------------------------------------------------------------------


@main.command()
def up() -> None:
    """Start api, scheduler, ingest and a local worker on embedded defaults (SQLite, a private Redis
    unless TORCHYARD_REDIS_URL is set). Prints the URL and an admin token; Ctrl-C stops it all."""
    from torchyard.local import up as run_up

    sys.exit(run_up(get_settings()))


@main.command()
@click.option("--host", default=None, help="bind address (TORCHYARD_HOST)")
@click.option("--port", type=int, default=None, help="port (TORCHYARD_PORT)")
@click.option("--scheduler/--no-scheduler", default=True, help="run the scheduler inside the api")
def api(host: str | None, port: int | None, scheduler: bool) -> None:
    """Serve the REST api, the live stream and the front end."""
    import uvicorn

    from backend import scheduler as sched
    from backend.app import create_app

    settings = _server_settings()
    stop = threading.Event()
    if scheduler:
        threading.Thread(target=sched.serve, args=(stop,), name="scheduler", daemon=True).start()
    try:
        uvicorn.run(
            create_app(),
            host=host or settings.host,
            port=port or settings.port,
            log_level="info",
            timeout_graceful_shutdown=5,  # live streams of running runs would hold shutdown forever
        )
    finally:
        stop.set()


@main.command()
def scheduler() -> None:
    """Run the scheduler alone (one leader at a time holds a Redis lock)."""
    from backend import scheduler as sched

    _server_settings()
    _serve_until_signal(sched.serve)


@main.command()
def ingest() -> None:
    """Write the run streams (metrics, logs, reports) to the database."""
    from backend import ingest as ing

    _server_settings()
    _serve_until_signal(ing.serve)


@main.command()
@click.option("--concurrency", type=int, default=None, help="runs at once (default: TORCHYARD_NODE_SLOTS)")
def worker(concurrency: int | None) -> None:
    """Run this node's Celery worker: heartbeats its capacity, launches runs placed on it."""
    settings = get_settings()
    if not settings.redis_url:
        raise click.UsageError("TORCHYARD_REDIS_URL must point at the cluster's Redis")
    from workers.celery_app import app, node_queue

    app.worker_main([
        "worker", "--queues", node_queue(settings.node_id), "--hostname", f"{settings.node_id}@%h",
        "--concurrency", str(concurrency or settings.node_slots), "--pool", "prefork",
        "--loglevel", "INFO", "--without-gossip", "--without-mingle",
    ])  # fmt: skip


@main.command()
def migrate() -> None:
    """Upgrade the database schema to the newest migration; install TORCHYARD_ADMIN_TOKEN, or
    create an admin token (printed once) if the database has none."""
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


# ---- client ------------------------------------------------------------------------------------


api_options = [
    click.option("--api-url", default=None, help="api address (TORCHYARD_API_URL)"),
    click.option("--token", default=None, help="bearer token (TORCHYARD_TOKEN)"),
]


def with_api(fn: Any) -> Any:
    for option in reversed(api_options):
        fn = option(fn)
    return fn


@main.command()
@click.argument("spec_file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", help="run name (default: workload-strategy)")
@click.option("--workload", default="mlp", show_default=True, help="built-in workload: mlp, charlm, fail")
@click.option("--param", "params", multiple=True, help="workload parameter KEY=VALUE (repeatable)")
@click.option("--strategy", default="ddp", show_default=True, help="ddp, fsdp, pipeline, local_sgd, zero")
@click.option("--strategy-opt", "strategy_opts", multiple=True, help="strategy option KEY=VALUE (repeatable)")
@click.option("--nodes", type=int, default=1, show_default=True, help="nodes, placed together (all or none)")
@click.option("--procs", type=int, default=2, show_default=True, help="processes per node")
@click.option("--device", default="cpu", show_default=True)
@click.option("--priority", type=int, default=0, show_default=True, help="higher is placed first")
@click.option("--steps", type=int, default=100, show_default=True)
@click.option("--batch-size", type=int, default=64, show_default=True, help="global batch")
@click.option("--lr", type=float, default=0.01, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--training-opt",
    "training_opts",
    multiple=True,
    help="training option KEY=VALUE (repeatable): checkpoint_every, max_restarts, stall_timeout_s, ...",
)
@click.option("--follow", is_flag=True, help="stream its logs until it ends")
@with_api
def submit(
    spec_file: Path | None,
    name: str | None,
    workload: str,
    params: tuple[str, ...],
    strategy: str,
    strategy_opts: tuple[str, ...],
    nodes: int,
    procs: int,
    device: str,
    priority: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    training_opts: tuple[str, ...],
    follow: bool,
    api_url: str | None,
    token: str | None,
) -> None:
    """Submit a run from SPEC_FILE (JSON) or from the options."""
    if spec_file:
        try:
            spec = json.loads(spec_file.read_text())
        except ValueError as exc:
            raise click.BadParameter(f"{spec_file} is not JSON: {exc}") from exc
    else:
        spec = {
            "name": name or f"{workload}-{strategy}",
            "workload": {"kind": "builtin", "name": workload, "params": dict(_parse_param(p) for p in params)},
            "strategy": {"kind": strategy, **dict(_parse_param(p) for p in strategy_opts)},
            "resources": {"nodes": nodes, "procs_per_node": procs, "device": device, "priority": priority},
            "training": {
                "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
                **dict(_parse_param(p) for p in training_opts),
            },
        }  # fmt: skip
    client = Api(api_url, token)
    run = client.call("POST", "/api/v1/runs", json=spec)
    click.echo(f"run {run['id']} {run['status']}: {run['name']}")
    if follow:
        sys.exit(follow_run(client, run["id"]))


def _parse_param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"--param {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


@main.command("submit-script", context_settings={"ignore_unknown_options": True})
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--entry", required=True, help="the script to run, relative to SOURCE (e.g. train.py)")
@click.option("--name", help="run name (default: the entry)")
@click.option("--nodes", type=int, default=1, show_default=True, help="nodes, placed together (torchrun's --nnodes)")
@click.option(
    "--procs", type=int, default=2, show_default=True, help="processes per node (torchrun's --nproc-per-node)"
)
@click.option("--device", default="cpu", show_default=True)
@click.option("--steps", type=int, default=100, show_default=True, help="steps you expect (progress display only)")
@click.option("--follow", is_flag=True, help="stream its logs until it ends")
@with_api
def submit_script(
    source: Path,
    script_args: tuple[str, ...],
    entry: str,
    name: str | None,
    nodes: int,
    procs: int,
    device: str,
    steps: int,
    follow: bool,
    api_url: str | None,
    token: str | None,
) -> None:
    """Upload SOURCE (a folder, zipped here, or a .zip/.tar.gz) and run its ENTRY script as
    torchrun would, with SCRIPT_ARGS (after --): `torchyard submit-script . --entry train.py -- --epochs 3`."""
    client = Api(api_url, token)
    data, filename = _bundle_bytes(source)
    bundle = client.call("POST", "/api/v1/bundles", files={"file": (filename, data, "application/octet-stream")})
    click.echo(f"bundle {bundle['id'][:12]} ({bundle['size']} bytes, {len(bundle['files'])} files)")
    spec = {
        "name": name or entry,
        "workload": {"kind": "script", "bundle": bundle["id"], "entry": entry, "args": list(script_args)},
        "resources": {"nodes": nodes, "procs_per_node": procs, "device": device},
        "training": {"steps": steps},
    }
    run = client.call("POST", "/api/v1/runs", json=spec)
    click.echo(f"run {run['id']} {run['status']}: {run['name']}")
    if follow:
        sys.exit(follow_run(client, run["id"]))


def _bundle_bytes(source: Path) -> tuple[bytes, str]:
    """An archive as is, or a folder zipped (without caches and hidden folders)."""
    if source.is_file():
        return source.read_bytes(), source.name
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(source.rglob("*")):
            rel = path.relative_to(source)
            if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                zf.write(path, rel.as_posix())
    return buf.getvalue(), f"{source.resolve().name or 'code'}.zip"


@main.command()
@click.option("--status", default=None, help="comma list of states")
@click.option("--name", default=None, help="substring of the name")
@click.option("--limit", type=int, default=20, show_default=True)
@with_api
def runs(status: str | None, name: str | None, limit: int, api_url: str | None, token: str | None) -> None:
    """List runs, newest first."""
    params = {k: v for k, v in {"status": status, "name": name, "limit": limit}.items() if v is not None}
    page = Api(api_url, token).call("GET", "/api/v1/runs", params=params)
    click.echo(f"{'ID':>5}  {'STATUS':<11} {'STEP':>9}  NAME")
    for run in page["items"]:
        total = run["spec"]["training"]["steps"]
        click.echo(f"{run['id']:>5}  {run['status']:<11} {run['last_step']:>4}/{total:<4}  {run['name']}")
    click.echo(f"({len(page['items'])} of {page['total']})")


@main.command()
@click.argument("run_id", type=int)
@click.option("--rank", type=int, default=None, help="only this rank (-1: the launcher)")
@click.option("--follow", "-f", is_flag=True, help="keep streaming until the run ends")
@with_api
def logs(run_id: int, rank: int | None, follow: bool, api_url: str | None, token: str | None) -> None:
    """Print a run's logs, each line with its rank."""
    client = Api(api_url, token)
    if follow:
        sys.exit(follow_run(client, run_id, rank))
    after = 0
    while True:
        params: dict[str, Any] = {"after": after, "limit": 5000}
        if rank is not None:
            params["rank"] = rank
        lines = client.call("GET", f"/api/v1/runs/{run_id}/logs", params=params)
        for line in lines:
            click.echo(format_line(line["rank"], line["text"]))
        if len(lines) < 5000:
            return
        after = lines[-1]["id"]


@main.command()
@click.argument("run_id", type=int)
@with_api
def cancel(run_id: int, api_url: str | None, token: str | None) -> None:
    """Cancel a run: every one of its processes ends."""
    run = Api(api_url, token).call("POST", f"/api/v1/runs/{run_id}/cancel")
    click.echo(f"run {run['id']} {run['status']}")


@main.command()
@click.argument("run_id", type=int)
@click.option("--download", "step", type=int, default=None, help="download the checkpoint at this step (a tar)")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    help="file to write the download to (default: run-RUN-step-STEP.tar)",
)
@with_api
def checkpoints(run_id: int, step: int | None, output: Path | None, api_url: str | None, token: str | None) -> None:
    """List a run's complete checkpoints, or download one (--download STEP) as a tar archive."""
    client = Api(api_url, token)
    if step is None:
        listed = client.call("GET", f"/api/v1/runs/{run_id}/checkpoints")
        if not listed:
            click.echo(f"run {run_id} has no checkpoint yet")
            return
        click.echo(f"{'STEP':>9}  {'SIZE':>10}  {'FILES':>5}  CREATED")
        for c in listed:
            click.echo(f"{c['step']:>9}  {_bytes(c['size_bytes']):>10}  {c['files']:>5}  {c['created_at']}")
        return
    download(
        client, f"/api/v1/runs/{run_id}/checkpoints/{step}/download", output or Path(f"run-{run_id}-step-{step}.tar")
    )


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@main.group()
def token() -> None:
    """Manage bearer tokens (admin)."""


@token.command("create")
@click.option("--name", required=True, help="who or what the token is for")
@click.option("--role", type=click.Choice(["viewer", "member", "admin"]), default="member", show_default=True)
@with_api
def token_create(name: str, role: str, api_url: str | None, token: str | None) -> None:
    """Create a token; its secret is printed once."""
    created = Api(api_url, token).call("POST", "/api/v1/tokens", json={"name": name, "role": role})
    click.echo(f"token {created['id']} ({created['role']}) for {created['name']}: {created['token']}")


@token.command("list")
@with_api
def token_list(api_url: str | None, token: str | None) -> None:
    """List tokens (never their secrets)."""
    for t in Api(api_url, token).call("GET", "/api/v1/tokens"):
        state = f"revoked {t['revoked_at']}" if t["revoked_at"] else "active"
        click.echo(f"{t['id']:>4}  {t['role']:<7} {state:<10} {t['name']}")


@token.command("revoke")
@click.argument("token_id", type=int)
@with_api
def token_revoke(token_id: int, api_url: str | None, token: str | None) -> None:
    """Revoke a token: it stops working at once."""
    Api(api_url, token).call("DELETE", f"/api/v1/tokens/{token_id}")
    click.echo(f"token {token_id} revoked")


if __name__ == "__main__":
    main()
