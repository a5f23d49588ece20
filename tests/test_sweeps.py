"""Sweeps through a real stack (api with its scheduler and sweep controller, ingest, a worker; SQLite):
a bad sweep is a 422 naming what is wrong before any run starts; a sweep's trials are ordinary
2-rank runs, never more unfinished at once than max_concurrent, exactly n_trials of them numbered
once each though the api is killed mid-sweep; ASHA stops a diverging learning
rate at its first rung and cancels its run with the reason; cancelling a sweep cancels its runs.
In Chromium, against the same stack and sweeps: the sweep page's trials, best-so-far chart,
parallel coordinates, importance and pruned-at steps, and the new-sweep form's 422 by parameter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cli.client import Api
from cli.main import main as cli
from cli.sweeps import TRIAL_HEADER, follow_sweep, trial_line
from cli.wait import wait_for
from testkit.browser import browser_marks, shot
from testkit.chaos import Chaos
from testkit.stack import SWEEP_PARAMS, RunningStack, metric_rows, run_processes, sqlite_stack, sweep_spec
from torchyard.spec import MlpParams

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]

STEPS, RUNG = 1500, 50  # the pruning sweep: a trial's steps, and ASHA's first rung


SWEEPS: dict[str, int] = {}  # sweeps the browser test reads again: "both" (two parameters), "asha"
BOTH_SPACE = {
    "training.lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True},
    "workload.params.hidden": {"type": "int", "low": 8, "high": 32, "step": 8},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(tmp_path_factory.mktemp("sweeps")) as running:
        yield running


@pytest.fixture(scope="module")
def ui_stack(stack: RunningStack) -> RunningStack:
    """The browser fixtures (tests/conftest.py: ``page``) on this module's stack and its sweeps."""
    return stack


def ended_sweep(stack: RunningStack, sweep_id: int, timeout: float) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        sweep = stack.client.http.get(f"/api/v1/sweeps/{sweep_id}").json()
        done = sweep["status"] != "running" and all(t["state"] != "running" for t in sweep["trials"])
        return sweep if done else None

    return wait_for(ended, timeout, f"sweep {sweep_id} to end", interval=0.5)


def at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_a_bad_sweep_is_refused_naming_what_is_wrong_before_any_run_starts(stack: RunningStack) -> None:
    http = stack.client.http
    runs_before = http.get("/api/v1/runs").json()["total"]
    cases: list[tuple[dict[str, Any], list[Any], str]] = [
        ({"training.lrr": {"type": "float", "low": 0.1, "high": 1}}, ["body", "space", "training.lrr"], "no field"),
        ({"training.lr": {"type": "float", "low": 0.1, "high": 0.01}}, ["body", "space", "training.lr"], "empty"),
        (
            {"training.lr": {"type": "float", "low": 0, "high": 0.1, "log": True}},
            ["body", "space", "training.lr"],
            "> 0",
        ),
        ({"training.steps": {"type": "float", "low": 1, "high": 9}}, ["body", "space", "training.steps"], "integers"),
        (
            {"workload.params.hidden": {"type": "categorical", "choices": ["wide"]}},
            ["body", "space", "workload.params.hidden"],
            "valid integer",
        ),
        (
            {"training.lr": {"type": "int", "low": 1, "high": 200}},
            ["body", "space", "training.lr"],
            "less than or equal",
        ),
        ({"training.lr": {"type": "categorical", "choices": []}}, ["body", "space", "training.lr"], "at least 1"),
        (
            {"training.lr": {"type": "float", "low": 1e-3, "high": 0.1, "when": {"strategy.kind": ["ddp"]}}},
            ["body", "space", "training.lr", "when", "strategy.kind"],
            "not a parameter of the space",
        ),
    ]
    for space, loc, words in cases:
        got = http.post("/api/v1/sweeps", json=sweep_spec(space=space))
        assert got.status_code == 422, (space, got.text)
        error = got.json()["detail"][0]
        assert error["loc"][: len(loc)] == loc and words in error["msg"], (space, error)
    invalid_base = sweep_spec()
    invalid_base["base"]["training"]["batch_size"] = 33  # not divisible by the 2 ranks
    got = http.post("/api/v1/sweeps", json=invalid_base)
    assert got.status_code == 422 and "training.batch_size (33)" in got.text, got.text
    grid = http.post("/api/v1/sweeps", json=sweep_spec(sampler="grid"))
    assert grid.status_code == 422 and "needs a step" in grid.text, grid.text
    assert http.get("/api/v1/sweeps").json()["total"] == 0, "no sweep was made"
    assert http.get("/api/v1/runs").json()["total"] == runs_before, "no run was made"


def test_a_sweep_runs_each_trial_as_a_two_rank_run_never_more_at_once_than_max_concurrent_across_an_api_kill(
    stack: RunningStack,
) -> None:
    created = stack.client.http.post("/api/v1/sweeps", json=sweep_spec(space=BOTH_SPACE))
    assert created.status_code == 201, created.text
    sweep_id = created.json()["id"]

    def started(count: int) -> bool:
        return len(stack.client.http.get(f"/api/v1/sweeps/{sweep_id}").json()["trials"]) >= count

    wait_for(lambda: started(2), 60, "the first two trials", interval=0.2)
    Chaos(stack).kill("api")  # -9, with its scheduler and sweep controller: the rest from the database
    stack.stack.spawn("api")
    sweep = ended_sweep(stack, sweep_id, 120)
    assert sweep["status"] == "succeeded", sweep["status_reason"]
    trials = sweep["trials"]
    assert [t["number"] for t in trials] == [0, 1, 2, 3], "exactly n_trials, numbered once each"
    assert all(t["state"] == "complete" and t["value"] is not None for t in trials), trials
    assert len({t["params"]["training.lr"] for t in trials}) == 4
    best = min(trials, key=lambda t: t["value"])
    assert sweep["best_trial"] == best["number"] and sweep["best_value"] == best["value"]

    runs = [stack.client.run(t["run_id"]) for t in trials]
    intervals = []
    for trial, run in zip(trials, runs, strict=True):
        assert run["status"] == "succeeded" and run["name"] == f"lr-sweep · trial {trial['number']}"
        assert run["spec"]["training"]["lr"] == trial["params"]["training.lr"], "the trial's parameters, applied"
        assert run["spec"]["workload"]["params"]["hidden"] == trial["params"]["workload.params.hidden"]
        ranks = {rank for _attempt, rank, key, _step in metric_rows(stack.settings, run["id"]) if key == "loss"}
        assert ranks == {0, 1}, f"run {run['id']}: a real 2-rank run (ranks that logged loss: {ranks})"
        assert trial["value"] == pytest.approx(run["summary"]["final_loss"], rel=1e-6), "objective: the last loss"
        intervals.append((at(run["created_at"]), at(run["ended_at"])))
    # Unfinished at once (from creation, queued included, to the end): at most max_concurrent (2).
    most = max(sum(1 for s, e in intervals if s <= t < e) for t, _ in intervals)
    assert most <= 2, intervals
    assert most == 2, "two trials did run side by side"

    shown = CliRunner().invoke(cli, ["sweep", "show", str(sweep["id"]), "--api-url", stack.url, "--token", stack.token])
    assert shown.exit_code == 0, shown.output
    assert f"sweep {sweep['id']} succeeded" in shown.output and "training.lr=" in shown.output, shown.output
    assert shown.output.count(" complete ") == 4, shown.output
    SWEEPS["both"] = sweep_id


GRID_STEPS, LAST_K = 30, 5  # the lr sweep's trials: their steps, and the objective's mean over the last k
GRID = [10 ** (e / 2) for e in range(-8, 1)]  # 1e-4 … 1, half a decade apart


def one_process_loss(lr: float) -> float:
    """The mlp trained in this process as a trial's 1-rank run trains it: the same seed (model and
    data), the same batches in the same order; the mean of the last ``LAST_K`` steps' losses, as the
    sweep's objective takes it. (A trial of one rank: 12 trials of two cost 40 s more CPU to start;
    test_strategies.py shows that 2-rank DDP trains what one process trains, and the first test
    here that a sweep's trials may be 2-rank runs.)"""
    from workers.runtime.strategies.base import plain_step
    from workers.runtime.train import batches, seed_everything
    from workers.runtime.workloads import build_mlp

    seed_everything(0)
    workload = build_mlp(MlpParams(**SWEEP_PARAMS), seed=0)
    optimizer = workload.make_optimizer(workload.model.parameters(), lr)
    feed = batches(workload, 32, rank=0, world=1, seed=0)
    losses = [plain_step(workload.model, optimizer, workload, next(feed)).item() for _ in range(GRID_STEPS)]
    return sum(losses[-LAST_K:]) / LAST_K


@pytest.mark.timeout(240)  # ~90 s measured with two test workers on 2 cores: twice that
def test_a_tpe_sweep_over_a_log_uniform_lr_finds_the_lr_a_one_process_grid_finds_best(stack: RunningStack) -> None:
    # The grid first (a fraction of a second): where the loss is lowest. "Lowest": within 25% of the
    # grid's least loss (the losses span 0.6 … 6 here; the next grid points up and down are 2x and
    # more off); then widened by a grid step each way, as the best lr between grid points can lie up
    # to a step beyond the last good one.
    losses = {lr: one_process_loss(lr) for lr in GRID}
    least = min(losses.values())
    good = [i for i, lr in enumerate(GRID) if losses[lr] <= 1.25 * least]
    low, high = GRID[max(0, good[0] - 1)], GRID[min(len(GRID) - 1, good[-1] + 1)]
    assert high / low <= 10**2.5, f"the grid singles out a range ({losses})"
    spec = sweep_spec(
        steps=GRID_STEPS,
        space={"training.lr": {"type": "float", "low": GRID[0], "high": GRID[-1], "log": True}},
        objective={"metric": "loss", "direction": "minimize", "take": "mean_last_k", "k": LAST_K},
        n_trials=12,
        max_concurrent=2,
        sampler="tpe",
        seed=7,
        procs=1,
    )
    created = stack.client.http.post("/api/v1/sweeps", json=spec)
    assert created.status_code == 201, created.text
    sweep = ended_sweep(stack, created.json()["id"], 240)
    assert sweep["status"] == "succeeded", sweep["status_reason"]
    trials = sweep["trials"]
    assert [t["number"] for t in trials] == list(range(12)) and all(t["state"] == "complete" for t in trials)
    intervals = []
    for trial in trials:
        run = stack.client.run(trial["run_id"])
        ranks = {rank for _attempt, rank, key, _step in metric_rows(stack.settings, run["id"]) if key == "loss"}
        assert run["status"] == "succeeded" and ranks == {0}, f"trial {trial['number']}: a real run"
        lr = trial["params"]["training.lr"]
        assert trial["value"] == pytest.approx(one_process_loss(lr), rel=1e-2), f"trial {trial['number']}: lr {lr}"
        intervals.append((at(run["created_at"]), at(run["ended_at"])))
    most = max(sum(1 for s, e in intervals if s <= t < e) for t, _ in intervals)
    assert most <= 2, f"max_concurrent (2) exceeded: {intervals}"
    best = min(trials, key=lambda t: t["value"])
    assert sweep["best_trial"] == best["number"]
    lr = best["params"]["training.lr"]
    assert low <= lr <= high, f"best trial {best['number']}: lr {lr:.3g} outside {low:.3g} … {high:.3g} ({losses})"


def asha_spec() -> dict[str, Any]:
    """Trials one at a time in the grid's seeded order (lr 0.01 first), so each later trial meets
    the first at the rung, where lr 0.8 and 1.0 (Adam) have diverged. Enough steps that a trial is
    still training when the controller reads its first rung."""
    spec = sweep_spec(
        steps=STEPS,
        space={"training.lr": {"type": "categorical", "choices": [0.01, 1.0, 0.8]}},
        n_trials=3,
        max_concurrent=1,
        sampler="grid",
        seed=1,
        pruner={"kind": "asha", "min_steps": RUNG, "reduction_factor": 2},
    )
    spec["base"]["training"]["log_every"] = 10
    return spec


def test_asha_stops_a_diverging_learning_rate_at_its_first_rung_and_cancels_its_run(stack: RunningStack) -> None:
    created = stack.client.http.post("/api/v1/sweeps", json=asha_spec())
    assert created.status_code == 201, created.text
    sweep = ended_sweep(stack, created.json()["id"], 120)
    SWEEPS["asha"] = sweep["id"]
    trials = sweep["trials"]
    assert trials[0]["params"]["training.lr"] == 0.01 and trials[0]["state"] == "complete", trials
    diverging = trials[1:]
    pruned = [t for t in diverging if t["state"] == "pruned"]
    assert len(pruned) >= len(diverging) / 2, f"ASHA stopped at least half the diverging trials: {trials}"
    for trial in pruned:
        assert trial["pruned_at"] is not None and RUNG <= trial["pruned_at"] < STEPS, trial
        run = stack.client.wait_status(trial["run_id"], {"cancelled"}, timeout=30)
        events = stack.client.http.get(f"/api/v1/runs/{run['id']}/events").json()
        reason = f"pruned at step {trial['pruned_at']}: loss "
        assert any(e["to_status"] == "cancelling" and e["reason"].startswith(reason) for e in events), events
        assert run["status_reason"].startswith(reason), f"the run says why it ended: {run['status_reason']}"
        assert "asha" in trial["reason"] and run["last_step"] < STEPS, "stopped before its last step"
        assert not run_processes(run["id"], stack.settings.checkpoints), "its processes are gone"
    assert sweep["status"] == "succeeded" and sweep["best_trial"] == 0, sweep


def test_cancelling_a_sweep_cancels_its_runs_and_starts_no_more(
    stack: RunningStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep_spec(steps=100_000, procs=1, n_trials=6)))
    auth = ["--api-url", stack.url, "--token", stack.token]
    made = CliRunner().invoke(cli, ["sweep", "create", str(path), *auth])
    assert made.exit_code == 0, made.output
    sweep_id = int(made.output.split()[1])

    def two_running() -> list[dict[str, Any]] | None:
        trials = stack.client.http.get(f"/api/v1/sweeps/{sweep_id}").json()["trials"]
        return trials if len(trials) == 2 and all(t["run_status"] == "running" for t in trials) else None

    trials = wait_for(two_running, 60, "two trials running", interval=0.3)
    cancelled = CliRunner().invoke(cli, ["sweep", "cancel", str(sweep_id), *auth])
    assert cancelled.exit_code == 0 and "cancelled; 2 run(s) stopping" in cancelled.output, cancelled.output
    for trial in trials:
        run = stack.client.wait_status(trial["run_id"], {"cancelled"}, timeout=30)
        assert "sweep cancelled by" in run["status_reason"] or run["status"] == "cancelled"
    sweep = ended_sweep(stack, sweep_id, 30)
    assert sweep["status"] == "cancelled" and len(sweep["trials"]) == 2, "no trial started after the cancel"
    assert {t["state"] for t in sweep["trials"]} == {"cancelled"}, sweep["trials"]
    again = stack.client.http.post(f"/api/v1/sweeps/{sweep_id}/cancel")
    assert again.status_code == 409, again.text
    # Followed: the columns named once, over the rows (`show` names them, then follows; `create
    # --follow` follows at once); the exit code says the sweep did not succeed.
    shown = CliRunner().invoke(cli, ["sweep", "show", str(sweep_id), "--follow", *auth])
    assert shown.exit_code == 1 and shown.output.count(TRIAL_HEADER) == 1, shown.output
    capsys.readouterr()
    assert follow_sweep(Api(stack.url, stack.token), sweep_id) == 1
    assert capsys.readouterr().out.splitlines() == [TRIAL_HEADER, *(trial_line(t) for t in sweep["trials"])]


def browser_test(test: Any) -> Any:
    for mark in browser_marks():
        test = mark(test)
    return test


@pytest.fixture
def sweeps(stack: RunningStack) -> dict[str, int]:
    """The sweeps the browser test reads: those the tests above made, or where one of them did not
    record its sweep (run alone with -k, or failed before), one made here the same way (without
    the api kill), and its end checked as the test checks it."""
    for key, spec in (("both", sweep_spec(space=BOTH_SPACE)), ("asha", asha_spec())):
        if key in SWEEPS:
            continue
        created = stack.client.http.post("/api/v1/sweeps", json=spec)
        assert created.status_code == 201, created.text
        sweep = ended_sweep(stack, created.json()["id"], 120)
        assert sweep["status"] == "succeeded", f"the {key} sweep: {sweep['status_reason']}"
        if key == "both":
            assert [t["state"] for t in sweep["trials"]] == ["complete"] * 4, sweep["trials"]
        SWEEPS[key] = sweep["id"]
    return SWEEPS


@browser_test
@pytest.mark.timeout(120)  # 60 s for the page; the rest for its sweeps where the tests above made none
def test_the_sweep_page_draws_each_trial_the_best_so_far_the_parameters_and_their_importance(
    sweeps: dict[str, int], page: Any, stack: RunningStack
) -> None:
    from playwright.sync_api import expect

    http = stack.client.http
    sweep = http.get(f"/api/v1/sweeps/{sweeps['both']}").json()
    page.goto(f"/#/sweeps/{sweep['id']}")
    rows = page.get_by_test_id("trials").locator("tbody tr")
    expect(rows).to_have_count(4)
    first = sweep["trials"][0]
    expect(page.get_by_test_id("trial-0").get_by_role("link")).to_have_attribute("href", f"#/runs/{first['run_id']}")

    def chart() -> dict[str, Any] | None:
        got = page.evaluate("() => window.__torchyard.chart('sweep-best')")
        return got if got and got["x"] == [0, 1, 2, 3] else None

    drawn = wait_for(chart, 15, "the best-so-far chart's points", interval=0.2)
    values, best = drawn["ys"]
    assert values == pytest.approx([t["value"] for t in sweep["trials"]])
    assert best == pytest.approx([min(values[: i + 1]) for i in range(4)]) and best[-1] == pytest.approx(
        sweep["best_value"]
    )
    parallel = page.get_by_test_id("sweep-parallel")
    expect(parallel.locator("polyline")).to_have_count(4)
    expect(parallel.locator('[data-axis="training.lr"]')).to_have_attribute("data-log", "on")
    expect(parallel.locator('[data-axis="workload.params.hidden"]')).to_have_attribute("data-log", "off")
    expect(parallel.locator('[data-axis="objective"]')).to_have_count(1)
    for polyline in parallel.locator("polyline").all():  # through every axis: 2 parameters + the loss
        assert len((polyline.get_attribute("points") or "").split()) == 3
    importance = http.get(f"/api/v1/sweeps/{sweep['id']}/importance").json()
    assert importance["evaluator"] == "ped-anova" and importance["trials"] == 4, importance
    assert set(importance["importance"]) == set(sweep["spec"]["space"]), importance
    assert sum(importance["importance"].values()) == pytest.approx(1.0, abs=1e-6), importance
    expect(page.get_by_test_id("sweep-importance").locator("tr[data-param]")).to_have_count(2)
    shot(page, "sweep")

    asha = http.get(f"/api/v1/sweeps/{sweeps['asha']}").json()
    pruned = [t for t in asha["trials"] if t["state"] == "pruned"]
    page.goto(f"/#/sweeps/{asha['id']}")
    for trial in pruned:
        expect(page.get_by_test_id(f"pruned-at-{trial['number']}")).to_have_text(f" at step {trial['pruned_at']}")
    valueless = sum(1 for t in asha["trials"] if t["state"] != "complete")  # dashed grey
    expect(page.get_by_test_id("sweep-parallel").locator('polyline[stroke-dasharray="4 3"]')).to_have_count(valueless)

    # A new sweep from a trial's run page: an empty range is the server's 422, shown by its parameter.
    before = http.get("/api/v1/sweeps").json()["total"]
    page.goto(f"/#/runs/{first['run_id']}")
    page.get_by_test_id("new-sweep").click()
    expect(page.get_by_test_id("new-sweep-form")).to_be_visible()
    expect(page.locator('[name="param-0-path"]')).to_have_value("training.lr")
    page.locator('[name="param-0-low"]').fill("0.01")
    page.locator('[name="param-0-high"]').fill("0.01")
    page.get_by_test_id("submit-sweep").click()
    expect(page.get_by_test_id("param-error-0")).to_contain_text("training.lr: ")
    expect(page.get_by_test_id("param-error-0")).to_contain_text("the range is empty")
    shot(page, "sweep-new-422")
    assert http.get("/api/v1/sweeps").json()["total"] == before, "no sweep was made"
