"""The run page as TensorBoard and W&B users expect it, in a real browser against a real stack:
charts in sections folded per user, smoothing with the raw line beneath, a log-scale y axis,
per-rank lines, every series downloadable at full resolution; the header's figures from the api,
one throughput figure in the list, the run page and compare; and a log panel that opens on the
end of the log (a crash's traceback) with older pages on demand and noise folded away.
Screenshots go to test-output/screenshots/."""

from __future__ import annotations

import csv
import json
import re
import statistics
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from testkit.browser import browser_marks, shot, sync_api
from testkit.stack import RunningStack

playwright_sync = sync_api()
Page = playwright_sync.Page
expect = playwright_sync.expect

pytestmark = browser_marks()

STEPS = 1200  # more steps than a chart draws points (~670 at this width): the downloads must hold them all
CRASH_LINES = 12_000  # more than the panel's first page and than the 10,000 lines it used to read from the start
# Warnings go to stdout here, so they land in order among the lines (stderr is relayed apart).
CRASH_SCRIPT = f"""
import sys, warnings
warnings.showwarning = lambda m, c, f, n, file=None, line=None: print(warnings.formatwarning(m, c, f, n, line), end="")
def framework_call():  # warns about its caller: Python prints the caller's line under the warning
    warnings.warn("a framework's warning", stacklevel=2)
for i in range({CRASH_LINES}):
    print(f"line {{i}}")
    if i % 1000 == 999:
        print("USDT:2026-12-04 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start")
    if i == {CRASH_LINES} - 100:
        framework_call()
sys.stdout.flush()
raise RuntimeError("boom after many lines")
"""


@pytest.fixture(scope="module")
def runs(ui_stack: RunningStack) -> dict[str, int]:
    """Submitted together at the start: the crash (1 slot) and fig-a (2) run at once on the stack's 4
    slots, fig-b after the crash, before the tests that need it."""
    client = ui_stack.client
    crash = client.submit_script("crash", "crash.py", CRASH_SCRIPT)
    a = client.submit(name="fig-a", steps=STEPS, params={"hidden": 16}, log_every=1)
    b = client.submit(name="fig-b", steps=200, params={"hidden": 32}, lr=0.05)
    return {"a": a["id"], "b": b["id"], "crash": crash["id"]}


def finished(ui_stack: RunningStack, run_id: int, status: str = "succeeded") -> dict[str, Any]:
    return ui_stack.client.wait_status(run_id, {status}, timeout=150)


def read_chart(page: Page, test_id: str) -> dict[str, Any]:
    return dict(page.evaluate(f"() => window.__torchyard.chart('{test_id}')"))


def parse_shown(text: str) -> float:
    """A figure as the dashboard prints it ("1.23k", "4.5%", "0.1234", "1,234") as a number."""
    text = text.strip().replace(",", "")
    if text.endswith("%"):
        return float(text[:-1]) / 100
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], 1.0)
    return float(text[:-1] if scale != 1.0 else text) * scale


def close(shown: str, value: float, digits: int = 3) -> bool:
    """Whether ``shown`` is ``value`` to the significant digits the page prints."""
    return abs(parse_shown(shown) - value) <= abs(value) * 10 ** (1 - digits)


@pytest.mark.timeout(120)
def test_charts_sit_in_sections_each_folded_or_open_as_its_user_left_it(
    page: Page, ui_stack: RunningStack, runs: dict[str, int]
) -> None:
    finished(ui_stack, runs["a"])
    page.goto(f"/#/runs/{runs['a']}")
    sections = {
        "training": ["chart-loss", "chart-key_lr"],
        "speed": ["chart-throughput", "chart-steptime"],
        "communication": [
            "chart-key_comm_fraction",
            "chart-comm",
            "chart-key_first_comm_at_s",
            "chart-busbw",
            "chart-key_busbw_efficiency",
            "chart-key_comm_bytes",
            "chart-commkinds",  # comm_bytes_<kind>: DDP's all-reduce alone
        ],
        "system": ["chart-key_max_rss_bytes", "chart-key_param_bytes", "chart-key_optimizer_state_bytes"],
    }
    for section, charts in sections.items():
        box = page.get_by_test_id(f"section-{section}")
        for chart in charts:
            expect(box.get_by_test_id(chart)).to_be_visible()
    expect(page.get_by_test_id("section-other")).to_have_count(0)  # a built-in run logs nothing else
    # the step time is its parts stacked, and its legend shows each part, not their running sum
    page.wait_for_function("() => window.__torchyard.chart('chart-steptime')?.x.length > 100")
    stacked = read_chart(page, "chart-steptime")
    assert stacked["series"] == ["exposed comm", "compute", "data"]
    top, middle, bottom = stacked["ys"]
    assert all(t >= m >= b >= 0 for t, m, b in zip(top, middle, bottom, strict=True) if t is not None and b is not None)
    shot(page, "run-page-sections")
    # Every y label fits its axis (a fixed width once cut "512.7 KiB" to "12.7 KiB"): measured in the
    # page, in the axis's font, against the width the plot leaves it (less uPlot's 10 px tick and 5 px gap).
    for chart in ("chart-key_comm_bytes", "chart-key_max_rss_bytes", "chart-loss"):
        page.wait_for_function(f"() => window.__torchyard.chart('{chart}')?.yTicks.length > 1")
        drawn = read_chart(page, chart)
        widths = page.evaluate(
            "([labels, font]) => { const c = document.createElement('canvas').getContext('2d'); c.font = font;"
            " return labels.map((t) => c.measureText(t).width); }",
            [drawn["yTicks"], drawn["yFont"]],
        )
        assert max(widths) + 15 <= drawn["yAxisPx"] + 0.5, (chart, drawn["yTicks"], widths, drawn["yAxisPx"])

    page.get_by_test_id("toggle-communication").click()
    expect(page.get_by_test_id("section-communication").get_by_test_id("chart-comm")).to_have_count(0)
    page.reload()
    expect(page.get_by_test_id("section-communication")).to_have_attribute("data-open", "false")
    expect(page.get_by_test_id("section-training")).to_have_attribute("data-open", "true")
    shot(page, "run-page-folded")

    # another user, same browser: their own settings, not this user's
    other = ui_stack.client.http.post("/api/v1/tokens", json={"name": "ui-other", "role": "viewer"}).json()
    page.get_by_test_id("logout").click()
    # the logout's response clears the session cookie: let it land before the next login sets one
    expect(page.get_by_role("button", name="Sign in")).to_be_visible()
    page.goto(f"/#/login?token={other['token']}")
    page.wait_for_url(re.compile(r"#/runs$"))
    page.goto(f"/#/runs/{runs['a']}")
    expect(page.get_by_test_id("section-communication")).to_have_attribute("data-open", "true")


@pytest.mark.timeout(120)
def test_smoothing_log_scale_and_per_rank_lines(page: Page, ui_stack: RunningStack, runs: dict[str, int]) -> None:
    finished(ui_stack, runs["a"])
    page.goto(f"/#/runs/{runs['a']}")
    page.wait_for_function("() => window.__torchyard.chart('chart-loss')?.x.length > 100")
    raw = read_chart(page, "chart-loss")
    assert raw["series"] == ["mean", "min", "max"]

    page.get_by_test_id("smoothing").fill("0.9")
    page.wait_for_function("() => window.__torchyard.chart('chart-loss')?.series.includes('mean (raw)')")
    smoothed = read_chart(page, "chart-loss")
    assert smoothed["series"] == ["mean (raw)", "min", "max", "mean"]
    raw_mean, smooth_mean = smoothed["ys"][0], smoothed["ys"][3]
    assert raw_mean == raw["ys"][0], "the raw line stays, beneath"

    def wiggle(ys: list[float | None]) -> float:
        values = [y for y in ys if y is not None]
        return statistics.mean(abs(b - a) for a, b in pairwise(values))

    assert wiggle(smooth_mean) < wiggle(raw_mean) / 3, (wiggle(smooth_mean), wiggle(raw_mean))
    shot(page, "run-page-smoothed")

    page.get_by_test_id("log-y").check()
    page.wait_for_function("() => window.__torchyard.chart('chart-loss')?.log === true")
    expect(page.get_by_test_id("chart-loss")).to_have_attribute("data-log", "on")
    assert all(y is None or y > 0 for col in read_chart(page, "chart-loss")["ys"] for y in col)
    shot(page, "run-page-log-scale")
    page.get_by_test_id("log-y").uncheck()
    page.get_by_test_id("smoothing").fill("0")

    page.get_by_test_id("per-rank").check()
    page.wait_for_function("() => window.__torchyard.chart('chart-loss')?.series.join() === 'rank 0,rank 1'")
    page.wait_for_function("() => window.__torchyard.chart('chart-loss').x.length > 100")
    per_rank = read_chart(page, "chart-loss")
    api = ui_stack.client.http.get(
        f"/api/v1/runs/{runs['a']}/metrics", params={"key": "loss", "max_points": 10_000}
    ).json()
    for rank, ys in enumerate(per_rank["ys"]):
        own = dict(zip(api["ranks"][str(rank)]["step"], api["ranks"][str(rank)]["value"], strict=True))
        drawn = [(x, y) for x, y in zip(per_rank["x"], ys, strict=True) if y is not None]
        assert drawn and all(own[x] == y for x, y in drawn), f"rank {rank}'s own values"
    assert per_rank["ys"][0] != per_rank["ys"][1]
    shot(page, "run-page-per-rank")
    page.get_by_test_id("per-rank").uncheck()


@pytest.mark.timeout(120)
def test_any_series_downloads_as_csv_and_json_at_full_resolution(
    page: Page, ui_stack: RunningStack, runs: dict[str, int], tmp_path: Path
) -> None:
    finished(ui_stack, runs["a"])
    page.goto(f"/#/runs/{runs['a']}")
    page.wait_for_function("() => window.__torchyard.chart('chart-loss')?.x.length > 100")
    drawn = len(read_chart(page, "chart-loss")["x"])
    assert drawn < STEPS, "the chart is downsampled: a download of the drawn points would miss some"

    chart = page.get_by_test_id("chart-loss")
    chart.get_by_text("Download").click()
    shot(page, "run-page-download")
    with page.expect_download() as got:
        chart.get_by_test_id("download-loss-csv").click()
    path = tmp_path / "loss.csv"
    got.value.save_as(path)
    assert got.value.suggested_filename == f"run-{runs['a']}-loss.csv"
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == STEPS * 2, "every step of both ranks"
    assert {(int(r["step"]), int(r["rank"])) for r in rows} == {(s, k) for s in range(1, STEPS + 1) for k in (0, 1)}
    api = ui_stack.client.http.get(
        f"/api/v1/runs/{runs['a']}/metrics", params={"key": "loss", "max_points": 10_000}
    ).json()
    rank1 = [float(r["value"]) for r in rows if r["rank"] == "1"]
    assert rank1 == api["ranks"]["1"]["value"]

    with page.expect_download() as got_json:
        chart.get_by_test_id("download-loss-json").click()
    body = json.loads(Path(got_json.value.path()).read_text())
    assert body["columns"] == ["step", "rank", "attempt", "value", "ts"] and len(body["rows"]) == STEPS * 2
    assert [row[3] for row in body["rows"] if row[1] == 1] == rank1

    missing = ui_stack.client.http.get(f"/api/v1/runs/{runs['a']}/metrics/export", params={"key": "nope"})
    assert missing.status_code == 404 and "has no metric 'nope'" in missing.json()["detail"]


@pytest.mark.timeout(120)
def test_throughput_has_one_definition_in_the_list_the_run_page_and_compare(
    page: Page, ui_stack: RunningStack, runs: dict[str, int]
) -> None:
    http = ui_stack.client.http
    a, b = finished(ui_stack, runs["a"]), finished(ui_stack, runs["b"])
    listed = {r["id"]: r for r in http.get("/api/v1/runs", params={"limit": 100}).json()["items"]}
    for run in (a, b):
        # GET /runs/{id} carries the list's figure, and the run's summary: none of it null
        assert run["samples_per_s"] == listed[run["id"]]["samples_per_s"] is not None
        assert run["comm_fraction"] == listed[run["id"]]["comm_fraction"] is not None
        assert all(v is not None for v in run["summary"].values()), run["summary"]
        # ... by its definition: the global batch over the step time, from every rank's own points
        times = http.get(
            f"/api/v1/runs/{run['id']}/metrics", params={"key": "step_time_s", "max_points": 10_000}
        ).json()
        at_last = max(times["ranks"][r]["value"][-1] for r in ("0", "1"))
        assert run["samples_per_s"] == pytest.approx(64 / at_last)
        every = [v for r in ("0", "1") for v in times["ranks"][r]["value"]]
        assert run["summary"]["mean_samples_per_s"] == pytest.approx(64 / statistics.mean(every))
        losses = http.get(f"/api/v1/runs/{run['id']}/metrics", params={"key": "loss", "max_points": 10_000}).json()
        assert run["summary"]["best_loss"] == pytest.approx(min(losses["aggregate"]["mean"]))
        assert run["summary"]["final_loss"] == pytest.approx(losses["aggregate"]["mean"][-1])

    page.goto("/#/runs")
    in_list = page.get_by_test_id(f"run-row-{a['id']}").get_by_test_id("throughput").inner_text()
    assert close(in_list, a["samples_per_s"])

    page.goto(f"/#/runs/{a['id']}")
    head = page.get_by_test_id("run-summary")
    expect(head.get_by_test_id("mean-throughput")).not_to_have_text("—")
    shown = {
        k: head.get_by_test_id(k).inner_text() for k in ("mean-throughput", "mean-comm", "final-loss", "best-loss")
    }
    assert close(shown["mean-throughput"], a["summary"]["mean_samples_per_s"])
    assert abs(parse_shown(shown["mean-comm"]) - a["summary"]["mean_comm_fraction"]) < 0.01
    assert close(shown["final-loss"], a["summary"]["final_loss"], 4) and close(
        shown["best-loss"], a["summary"]["best_loss"], 4
    )
    shot(page, "run-page-summary")

    page.goto(f"/#/compare?ids={a['id']},{b['id']}")
    row = page.get_by_test_id("compare-summary").locator(f"tr[data-run='{a['id']}']")
    expect(row.get_by_test_id("last-throughput")).to_have_text(in_list)
    expect(row.get_by_test_id("mean-throughput")).to_have_text(shown["mean-throughput"])
    expect(row.get_by_test_id("final-loss")).to_have_text(shown["final-loss"])
    # the compare chart draws the same per-step figure: the batch over the step's slowest rank
    page.wait_for_function("() => window.__torchyard.chart('compare-throughput')?.x.length > 10")
    compare = read_chart(page, "compare-throughput")
    times = http.get(f"/api/v1/runs/{a['id']}/metrics", params={"key": "step_time_s", "max_points": 10_000}).json()
    slowest = {
        s: max(v0, v1)
        for s, v0, v1 in zip(
            times["ranks"]["0"]["step"], times["ranks"]["0"]["value"], times["ranks"]["1"]["value"], strict=True
        )
    }
    drawn = [(x, y) for x, y in zip(compare["x"], compare["ys"][0], strict=True) if y is not None]
    assert len(drawn) > 10 and all(y == pytest.approx(64 / slowest[x]) for x, y in drawn)
    shot(page, "compare-summary")


def test_compare_strategies_queues_one_run_per_strategy_and_compares_them(
    page: Page, ui_stack: RunningStack, runs: dict[str, int]
) -> None:
    b = finished(ui_stack, runs["b"])
    page.goto(f"/#/runs/{b['id']}")
    page.get_by_test_id("compare-strategies").click()
    card = page.get_by_test_id("strategy-comparison")
    expect(card).to_contain_text("Not fsdp_tp: strategy.tp_degree (2)")
    link = card.get_by_test_id("open-comparison").get_attribute("href") or ""
    ids = [int(i) for i in link.split("ids=")[1].split(",")]
    try:
        kinds = {ui_stack.client.run(i)["spec"]["strategy"]["kind"] for i in ids}
        assert {"ddp", "fsdp", "zero", "local_sgd", "tp", "pipeline", "async"} == kinds
    finally:  # the comparison's runs are not this module's to run: they would slow its other tests
        for run_id in ids:
            ui_stack.client.http.post(f"/api/v1/runs/{run_id}/cancel")
    card.get_by_test_id("open-comparison").click()
    summary = page.get_by_test_id("compare-summary")
    expect(summary.locator("tbody tr")).to_have_count(len(ids))
    expect(summary).to_contain_text("Comm bytes/step")
    expect(summary.get_by_text("cancelled")).to_have_count(len(ids), timeout=30_000)  # read again until they end


@pytest.mark.timeout(120)
def test_the_log_panel_opens_on_the_traceback_pages_back_and_folds_noise(
    page: Page, ui_stack: RunningStack, runs: dict[str, int]
) -> None:
    run_id = runs["crash"]
    finished(ui_stack, run_id, "failed")
    http, base = ui_stack.client.http, f"/api/v1/runs/{run_id}/logs"
    # the api pages back from the end with no gap and no overlap
    tail = http.get(base, params={"tail": True, "limit": 100}).json()
    before = http.get(base, params={"before": tail[0]["id"], "limit": 100}).json()
    ids = [line["id"] for line in before + tail]
    assert ids == sorted(ids) and len(set(ids)) == 200 and before[-1]["id"] < tail[0]["id"]
    assert tail[-1]["text"].startswith("=====") or "line" in tail[-1]["text"]  # the end: torchrun's summary
    found = http.get(base, params={"contains": "RuntimeError: boom", "rank": 0}).json()
    assert [line["text"] for line in found] == ["RuntimeError: boom after many lines"]

    page.goto(f"/#/runs/{run_id}")
    card, logs = page.get_by_test_id("logs-card"), page.get_by_test_id("logs")
    expect(logs).to_contain_text(f"line {CRASH_LINES - 1}")
    # the rank's traceback, wherever it sits in the log (stdout and stderr are relayed apart: the
    # script's last printed lines arrived after it), is in the panel at first load
    failure = card.get_by_test_id("log-failure")
    try:
        expect(failure).to_contain_text("Traceback (most recent call last)", timeout=45_000)
    except AssertionError as e:
        starts = http.get(base, params={"contains": "Traceback (most recent", "tail": True, "limit": 100}).json()
        search = card.get_attribute("data-failure-search")
        raise AssertionError(
            f"no traceback card; the card's search: {search!r}; the api's traceback starts: {starts}"
        ) from e
    print("the traceback card:", card.get_attribute("data-failure-search"))
    expect(failure).to_contain_text('raise RuntimeError("boom after many lines")')
    expect(failure.locator("pre")).to_have_text(re.compile(r"RuntimeError: boom after many lines$"))
    # the log itself opens scrolled to its end
    page.wait_for_function(
        "() => { const el = document.querySelector('[data-testid=logs]');"
        " return el.scrollHeight > el.clientHeight && el.scrollHeight - el.scrollTop - el.clientHeight < 5; }"
    )
    noise = page.get_by_test_id("log-noise-toggle")
    expect(noise).to_contain_text("hidden (profiler, warning)")
    expect(logs.locator("div", has_text="USDT:")).to_have_count(0)
    expect(logs.locator("div", has_text="framework_call()")).to_have_count(0)  # the warning's own line folds with it
    shot(page, "run-page-logs-traceback")

    def first_numbered() -> int:
        return int(re.search(r"\bline (\d+)\b", logs.inner_text()).group(1))  # type: ignore[union-attr]

    oldest = first_numbered()
    assert oldest > CRASH_LINES - 2000, "the panel starts at the end of the log"
    page.get_by_test_id("log-older").click()
    page.wait_for_function(
        f"() => /\\bline (\\d+)\\b/.exec(document.querySelector('[data-testid=logs]').innerText)[1] < {oldest}"
    )
    assert oldest - first_numbered() > 1900, "a page of older lines, right before the first"
    noise.click()
    expect(logs.locator("div.noise", has_text="USDT:").first).to_be_visible()
    expect(logs.locator("div.noise", has_text="UserWarning: a framework's warning")).to_have_count(1)
    expect(logs.locator("div.noise", has_text="framework_call()")).to_have_count(1)
    shot(page, "run-page-logs-older")


# Steps (optimizer.step) but no backward() on a one-element tensor: there is no loss to take.
NO_LOSS_SCRIPT = """
import torch
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    out = model(torch.randn(8, 4))
    out.backward(torch.ones_like(out))
    optimizer.step()
    optimizer.zero_grad()
"""


@pytest.mark.timeout(120)
def test_a_script_run_without_a_loss_says_how_to_log_one(page: Page, ui_stack: RunningStack) -> None:
    run = ui_stack.client.submit_script("no-loss", "noloss.py", NO_LOSS_SCRIPT)
    done = finished(ui_stack, run["id"])
    assert done["last_step"] == 20 and done["summary"]["final_loss"] is None
    page.goto(f"/#/runs/{run['id']}")
    hint = page.get_by_test_id("no-loss-hint")
    expect(hint).to_contain_text("torchyard.log(step, loss=loss.item())")
    shot(page, "run-detail-no-loss-hint")
