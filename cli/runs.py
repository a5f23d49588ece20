"""``torchyard submit``, ``submit-script``, ``runs``, ``logs``, ``compare-strategies``, ``cancel``,
``project``, ``checkpoints``: runs through the api."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from cli.client import Api, download, follow_run, format_line, with_api
from torchyard.spec import strategy_kinds
from torchyard.units import fmt_bytes

ON_BAD_SHARD = click.option(
    "--on-bad-shard",
    type=click.Choice(["fail", "skip"]),
    default=None,
    help="with --dataset: a missing or corrupt shard fails the run naming it (the default), or is skipped and counted",
)

STALL_TIMEOUT = click.option(
    "--stall-timeout",
    "stall_timeout_s",
    type=click.FloatRange(min=0),
    default=None,
    help="seconds without a step before the run is restarted from its last checkpoint, or failed when out of "
    "attempts (training.stall_timeout_s); unset: a stall is only flagged, with its diagnosis",
)


def _stall(stall_timeout_s: float | None) -> dict[str, float]:
    return {} if stall_timeout_s is None else {"stall_timeout_s": stall_timeout_s}


@click.command()
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
@STALL_TIMEOUT
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
    stall_timeout_s: float | None,
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
                **_stall(stall_timeout_s), **dict(_parse_param(p) for p in training_opts),
            },
            **_data(dataset, on_bad_shard),
        }  # fmt: skip
    start(Api(api_url, token), spec, follow)


def _data(dataset: str | None, on_bad_shard: str | None) -> dict[str, Any]:
    """The spec's ``data`` section from the options (none without --dataset)."""
    if on_bad_shard and not dataset:
        raise click.UsageError("--on-bad-shard needs --dataset: it says what a bad shard of that dataset does")
    if not dataset:
        return {}
    return {"data": {"dataset": dataset, **({"on_bad_shard": on_bad_shard} if on_bad_shard else {})}}


def start(client: Api, spec: dict[str, Any], follow: bool) -> None:
    """Submit the run; with ``follow``, stream its logs and exit as it ended."""
    run = client.call("POST", "/api/v1/runs", json=spec)
    submitted(run)
    if follow:
        sys.exit(follow_run(client, run["id"]))


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


@click.command("submit-script", context_settings={"ignore_unknown_options": True})
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
@STALL_TIMEOUT
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
    stall_timeout_s: float | None,
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
        "training": {"steps": steps, **_stall(stall_timeout_s)},
        **_data(dataset, on_bad_shard),
    }
    start(client, spec, follow)


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


@click.command()
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
        click.echo(f"{run['id']:>5}  {run['status']:<11} {step_of(run):>9}  {run['name']}")
    click.echo(f"({len(page['items'])} of {page['total']})")


@click.command()
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


@click.command("compare-strategies")
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


@click.command()
@click.argument("run_id", type=int)
@with_api
def cancel(run_id: int, api_url: str | None, token: str | None) -> None:
    """Cancel a run: every one of its processes ends."""
    run = Api(api_url, token).call("POST", f"/api/v1/runs/{run_id}/cancel")
    click.echo(f"run {run['id']} {run['status']}")


@click.command()
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


@click.command()
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


def step_of(run: dict[str, Any]) -> str:
    """ "step/steps"; a script's steps are only what its user expected (it stops when it will): a
    script past them shows its step alone, never "421/100"."""
    step, total = run["last_step"], run["spec"]["training"]["steps"]
    if run["spec"]["workload"]["kind"] == "script" and step > total:
        return str(step)
    return f"{step}/{total}"
