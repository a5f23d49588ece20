"""The ``torchyard`` command: start the system's processes, and talk to its api."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import click

from cli import sweeps as sweep_cli
from cli.client import Api, download, follow_run, format_line
from torchyard.settings import Settings, get_settings
from torchyard.spec import strategy_kinds
from torchyard.units import fmt_bytes


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """torchyard: run and watch distributed PyTorch training."""


def _platform_process() -> None:
    """Whatever the platform's processes create (state, bundles, records, the database) is theirs
    alone: ranks run as another user (workers/isolation.py) and get only what is handed to them."""
    os.umask(0o077)


# ---- processes ---------------------------------------------------------------------------------


@main.command()
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


@main.command()
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


@main.command()
@click.option("--host", default=None, help="bind address (TORCHYARD_HOST)")
@click.option("--port", type=int, default=None, help="port (TORCHYARD_PORT)")
@click.option(
    "--scheduler/--no-scheduler", default=True, help="run the scheduler (and the sweep controller) inside the api"
)
@click.option("--access-log/--no-access-log", default=True, help="log every request")
def api(host: str | None, port: int | None, scheduler: bool, access_log: bool) -> None:
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
            log_level="info",
            access_log=access_log,
            timeout_graceful_shutdown=5,  # live streams of running runs would hold shutdown forever
        )
    finally:
        stop.set()


@main.command()
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


@main.command()
def ingest() -> None:
    """Write the run streams (metrics, logs, reports) to the database."""
    _platform_process()
    from backend import ingest as ing

    _server_settings()
    _serve_until_signal(ing.serve)


@main.command()
@click.option("--concurrency", type=int, default=None, help="runs at once (default: TORCHYARD_NODE_SLOTS)")
@click.option(
    "--loglevel",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
    default="INFO",
    help="the worker's log level",
)
def worker(concurrency: int | None, loglevel: str) -> None:
    """Run this node's Celery worker: heartbeats its capacity, launches runs placed on it."""
    _platform_process()
    settings = get_settings()
    if not settings.redis_url:
        raise click.UsageError("TORCHYARD_REDIS_URL must point at the cluster's Redis")
    from torchyard.tasks import node_queue
    from workers.celery_app import app

    app.worker_main([
        "worker", "--queues", node_queue(settings.node_id), "--hostname", f"{settings.node_id}@%h",
        "--concurrency", str(concurrency or settings.node_slots), "--pool", "prefork",
        "--loglevel", loglevel, "--without-gossip", "--without-mingle",
    ])  # fmt: skip


@main.command()
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


# ---- client ------------------------------------------------------------------------------------


api_options = [
    click.option("--api-url", default=None, help="api address (TORCHYARD_API_URL)"),
    click.option("--token", default=None, help="bearer token (TORCHYARD_TOKEN)"),
]


def with_api(fn: Any) -> Any:
    for option in reversed(api_options):
        fn = option(fn)
    return fn


ON_BAD_SHARD = click.option(
    "--on-bad-shard",
    type=click.Choice(["fail", "skip"]),
    default=None,
    help="with --dataset: a missing or corrupt shard fails the run naming it (the default), or is skipped and counted",
)


@main.command()
@click.argument("spec_file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", help="run name (default, the api's: workload-strategy)")
@click.option("--workload", default="mlp", show_default=True, help="built-in workload: mlp, charlm, fail")
@click.option("--param", "params", multiple=True, help="workload parameter KEY=VALUE (repeatable)")
@click.option("--strategy", default="ddp", show_default=True, help=", ".join(strategy_kinds()))
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
@click.option("--dataset", default=None, help="train on this registered dataset (`torchyard dataset list`)")
@ON_BAD_SHARD
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
    dataset: str | None,
    on_bad_shard: str | None,
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
            **({"name": name} if name else {}),  # else the api names it
            "workload": {"kind": "builtin", "name": workload, "params": dict(_parse_param(p) for p in params)},
            "strategy": {"kind": strategy, **dict(_parse_param(p) for p in strategy_opts)},
            "resources": {"nodes": nodes, "procs_per_node": procs, "device": device, "priority": priority},
            "training": {
                "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
                **dict(_parse_param(p) for p in training_opts),
            },
            **_data(dataset, on_bad_shard),
        }  # fmt: skip
    client = Api(api_url, token)
    run = client.call("POST", "/api/v1/runs", json=spec)
    submitted(run)
    if follow:
        sys.exit(follow_run(client, run["id"]))


def _data(dataset: str | None, on_bad_shard: str | None) -> dict[str, Any]:
    """The spec's ``data`` section from the options (none without --dataset)."""
    if on_bad_shard and not dataset:
        raise click.UsageError("--on-bad-shard needs --dataset: it says what a bad shard of that dataset does")
    if not dataset:
        return {}
    return {"data": {"dataset": dataset, **({"on_bad_shard": on_bad_shard} if on_bad_shard else {})}}


def submitted(run: dict[str, Any]) -> None:
    click.echo(f"run {run['id']} {run['status']}: {run['name']}")
    for warning in run.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)


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
@click.option("--name", help="run name (default, the api's: the entry)")
@click.option("--nodes", type=int, default=1, show_default=True, help="nodes, placed together (torchrun's --nnodes)")
@click.option(
    "--procs", type=int, default=2, show_default=True, help="processes per node (torchrun's --nproc-per-node)"
)
@click.option("--device", default="cpu", show_default=True)
@click.option("--steps", type=int, default=100, show_default=True, help="steps you expect (progress display only)")
@click.option("--dataset", default=None, help="the registered dataset `torchyard.data.loader()` reads in the script")
@ON_BAD_SHARD
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
    dataset: str | None,
    on_bad_shard: str | None,
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
        **({"name": name} if name else {}),
        "workload": {"kind": "script", "bundle": bundle["id"], "entry": entry, "args": list(script_args)},
        "resources": {"nodes": nodes, "procs_per_node": procs, "device": device},
        "training": {"steps": steps},
        **_data(dataset, on_bad_shard),
    }
    run = client.call("POST", "/api/v1/runs", json=spec)
    submitted(run)
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


@main.command("compare-strategies")
@click.argument("run_id", type=int)
@with_api
def compare_strategies(run_id: int, api_url: str | None, token: str | None) -> None:
    """Queue a run's workload once per strategy that applies, to compare them side by side."""
    api = Api(api_url, token)
    got = api.call("POST", f"/api/v1/runs/{run_id}/strategy-comparison")
    for run in got["runs"]:
        click.echo(f"run {run['id']} {run['spec']['strategy']['kind']:<10} {run['status']}")
    for skipped in got["skipped"]:
        click.echo(f"not {skipped['strategy']}: {skipped['reason']}")
    ids = ",".join(str(run["id"]) for run in got["runs"])
    click.echo(f"compare them: {api.url}/#/compare?ids={ids}")


@main.command()
@click.argument("run_id", type=int)
@with_api
def cancel(run_id: int, api_url: str | None, token: str | None) -> None:
    """Cancel a run: every one of its processes ends."""
    run = Api(api_url, token).call("POST", f"/api/v1/runs/{run_id}/cancel")
    click.echo(f"run {run['id']} {run['status']}")


@main.command()
@click.argument("run_id", type=int)
@click.option("--ranks", default=None, help="world sizes: 1,2,4 or 1-64 (default 1,2,4,…,64)")
@click.option("--ranks-per-node", type=click.IntRange(1, None), default=None, help="default: as the run")
@click.option("--cores-per-node", type=click.IntRange(1, None), default=None, help="CPU runs; default: the run's node")
@with_api
def project(
    run_id: int,
    ranks: str | None,
    ranks_per_node: int | None,
    cores_per_node: int | None,
    api_url: str | None,
    token: str | None,
) -> None:
    """How fast a finished DDP or FSDP run would be on more ranks (weak scaling: each rank keeps its
    batch): step time, samples/s, scaling efficiency and memory per rank, and the assumptions."""
    query = {"ranks": ranks, "ranks_per_node": ranks_per_node, "cores_per_node": cores_per_node}
    params = {k: v for k, v in query.items() if v is not None}
    p = Api(api_url, token).call("GET", f"/api/v1/runs/{run_id}/projection", params=params)
    m = p["measured"]
    click.echo(
        f"run {run_id}: {p['strategy']} measured at {m['world']} ranks ({m['nodes']} × {m['ranks_per_node']}): "
        f"{m['samples_per_s']:,.0f} samples/s, {m['step_time_s'] * 1e3:.1f} ms a step"
    )
    click.echo(
        f"{'RANKS':>6} {'NODES':>6} {'STEP ms':>9} {'EXPOSED ms':>11} {'SAMPLES/S':>11} {'EFFICIENCY':>11}  MEMORY/RANK"
    )
    for pt in p["points"]:
        mark = "  (measured)" if pt["ranks"] == m["world"] else ""
        click.echo(
            f"{pt['ranks']:>6} {pt['nodes']:>6} {pt['step_time_s'] * 1e3:>9.1f} {pt['exposed_comm_s'] * 1e3:>11.1f} "
            f"{pt['samples_per_s']:>11,.0f} {pt['efficiency']:>11.0%}  {fmt_bytes(pt['peak_bytes'])}{mark}"
        )
    click.echo("\nassumptions:")
    for line in p["assumptions"]:
        click.echo(f"- {line}")
    click.echo("\nnot projected:")
    for kind, why in p["excluded"].items():
        click.echo(f"- {kind}: {why}")


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
            click.echo(f"{c['step']:>9}  {fmt_bytes(c['size_bytes']):>10}  {c['files']:>5}  {c['created_at']}")
        return
    download(
        client, f"/api/v1/runs/{run_id}/checkpoints/{step}/download", output or Path(f"run-{run_id}-step-{step}.tar")
    )


@main.group()
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
    from cli.datasets import create

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
@click.argument("which")
@with_api
def token_revoke(which: str, api_url: str | None, token: str | None) -> None:
    """Revoke a token, by id or by the name it was created with: it stops working at once."""
    api = Api(api_url, token)
    if which.isdigit():
        token_id = int(which)
    else:
        named = [t for t in api.call("GET", "/api/v1/tokens") if t["name"] == which and not t["revoked_at"]]
        if len(named) != 1:
            found = f"{len(named)} active tokens are named {which!r}" + (
                f" (ids {', '.join(str(t['id']) for t in named)}): give the id" if named else ""
            )
            raise click.ClickException(found)
        token_id = named[0]["id"]
    api.call("DELETE", f"/api/v1/tokens/{token_id}")
    click.echo(f"token {token_id} revoked")


@main.group()
def sweep() -> None:
    """Hyperparameter sweeps: each trial an ordinary distributed run, chosen and pruned by Optuna."""


@sweep.command("create")
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--follow", is_flag=True, help="print each trial as it starts and ends, until the sweep ends")
@with_api
def sweep_create(spec_file: Path, follow: bool, api_url: str | None, token: str | None) -> None:
    """Create a sweep from SPEC_FILE (JSON: base, space, objective, n_trials, max_concurrent, sampler, pruner)."""
    api = Api(api_url, token)
    created = sweep_cli.create(api, spec_file)
    if follow:
        sys.exit(sweep_cli.follow(api, created["id"]))


@sweep.command("show")
@click.argument("sweep_id", type=int)
@click.option("--follow", is_flag=True, help="then print each trial as it starts and ends, until the sweep ends")
@with_api
def sweep_show(sweep_id: int, follow: bool, api_url: str | None, token: str | None) -> None:
    """A sweep and its trials: parameters, state, objective, the step reached, the run."""
    api = Api(api_url, token)
    sweep_cli.show(api, sweep_id)
    if follow:
        sys.exit(sweep_cli.follow(api, sweep_id))


@sweep.command("cancel")
@click.argument("sweep_id", type=int)
@with_api
def sweep_cancel(sweep_id: int, api_url: str | None, token: str | None) -> None:
    """Cancel a sweep: no trial starts after this, and its unfinished runs are cancelled."""
    sweep_cli.cancel(Api(api_url, token), sweep_id)


if __name__ == "__main__":
    main()
