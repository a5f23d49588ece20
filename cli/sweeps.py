"""``torchyard sweep``: create a sweep from a JSON file, show it (its trials as a table; with
``--follow``, each trial's changes as they happen, until the sweep ends), cancel it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from cli.client import Api, with_api

FOLLOW_EVERY_S = 2.0
ENDED = {"succeeded", "failed", "cancelled"}


def create(api: Api, path: Path) -> dict[str, Any]:
    try:
        spec = json.loads(path.read_text())
    except ValueError as exc:
        raise click.BadParameter(f"{path} is not JSON: {exc}") from exc
    sweep: dict[str, Any] = api.call("POST", "/api/v1/sweeps", json=spec)
    click.echo(f"sweep {sweep['id']} {sweep['status']}: {sweep['name']} ({sweep['spec']['n_trials']} trials)")
    return sweep


def show(api: Api, sweep_id: int) -> dict[str, Any]:
    sweep: dict[str, Any] = api.call("GET", f"/api/v1/sweeps/{sweep_id}")
    click.echo(f"sweep {sweep['id']} {sweep['status']}: {sweep['name']}; {sweep['status_reason']}")
    if sweep["best_trial"] is not None:
        metric = sweep["spec"]["objective"]["metric"]
        click.echo(f"best: trial {sweep['best_trial']}, {metric} {_num(sweep['best_value'])}")
    click.echo(TRIAL_HEADER)
    for trial in sweep["trials"]:
        click.echo(trial_line(trial))
    return sweep


TRIAL_HEADER = f"{'#':>4}  {'state':<9} {'value':>10} {'step':>6} {'run':>6}  params"  # over trial_line's columns


def trial_line(trial: dict[str, Any]) -> str:
    params = " ".join(f"{k}={_num(v)}" for k, v in trial["params"].items())
    run = "-" if trial["run_id"] is None else str(trial["run_id"])
    line = f"{trial['number']:>4}  {trial['state']:<9} {_num(trial['value']):>10} {trial['reported_step']:>6} {run:>6}"
    line += f"  {params}"
    if trial["reason"]:
        line += f"  ({trial['reason']})"
    return line


def follow_sweep(api: Api, sweep_id: int, header: bool = True) -> int:
    """Prints each trial as it starts and as it ends (under the columns' header, unless ``show``
    just printed it), until the sweep ends; 0 if it succeeded."""
    said: dict[int, str] = {}
    while True:
        sweep = api.call("GET", f"/api/v1/sweeps/{sweep_id}")
        for trial in sweep["trials"]:
            if said.get(trial["number"]) != trial["state"]:
                if header:
                    click.echo(TRIAL_HEADER)
                    header = False
                said[trial["number"]] = trial["state"]
                click.echo(trial_line(trial))
        if sweep["status"] in ENDED and all(t["state"] != "running" for t in sweep["trials"]):
            click.echo(f"--- sweep {sweep['status']}: {sweep['status_reason']}", err=True)
            return 0 if sweep["status"] == "succeeded" else 1
        time.sleep(FOLLOW_EVERY_S)


def cancel(api: Api, sweep_id: int) -> None:
    sweep = api.call("POST", f"/api/v1/sweeps/{sweep_id}/cancel")
    stopping = [t for t in sweep["trials"] if t["run_status"] not in (None, *ENDED)]
    click.echo(f"sweep {sweep['id']} {sweep['status']}; {len(stopping)} run(s) stopping")


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@click.group()
def sweep() -> None:
    """Hyperparameter sweeps: each trial an ordinary distributed run, chosen and pruned by Optuna."""


@sweep.command("create")
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--follow", is_flag=True, help="print each trial as it starts and ends, until the sweep ends")
@with_api
def sweep_create(spec_file: Path, follow: bool, api_url: str | None, token: str | None) -> None:
    """Create a sweep from SPEC_FILE (JSON: base, space, objective, n_trials, max_concurrent, sampler, pruner)."""
    api = Api(api_url, token)
    created = create(api, spec_file)
    if follow:
        sys.exit(follow_sweep(api, created["id"]))


@sweep.command("show")
@click.argument("sweep_id", type=int)
@click.option("--follow", is_flag=True, help="then print each trial as it starts and ends, until the sweep ends")
@with_api
def sweep_show(sweep_id: int, follow: bool, api_url: str | None, token: str | None) -> None:
    """A sweep and its trials: parameters, state, objective, the step reached, the run."""
    api = Api(api_url, token)
    show(api, sweep_id)
    if follow:
        sys.exit(follow_sweep(api, sweep_id, header=False))


@sweep.command("cancel")
@click.argument("sweep_id", type=int)
@with_api
def sweep_cancel(sweep_id: int, api_url: str | None, token: str | None) -> None:
    """Cancel a sweep: no trial starts after this, and its unfinished runs are cancelled."""
    cancel(Api(api_url, token), sweep_id)
