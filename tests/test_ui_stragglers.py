"""Why is it slow, on the run page, in a real browser against a real stack: a run whose rank 1 starts
loading its data slowly mid-way names rank 1 as the straggler with its cause, draws every rank over
the steps in the heatmap (rank 1's data time dark, rank 0's light), and shows the slowdown's live
alert in the state history. Screenshots: test-output/screenshots/run-stragglers*.png."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cli.wait import wait_for
from testkit.browser import SHOTS, browser_marks, shot, sync_api
from testkit.stack import RunningStack, run_spec, sqlite_stack

playwright_sync = sync_api()
Page = playwright_sync.Page
expect = playwright_sync.expect

pytestmark = browser_marks()
STEPS = 50


@pytest.fixture(scope="module")
def ui_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """The dashboard's stack, raising live alerts without their 10 s span (this run is short)."""
    with sqlite_stack(tmp_path_factory.mktemp("ui-stragglers"), alert_after_s=0) as running:
        yield running


@pytest.mark.timeout(120)
def test_the_run_page_names_the_straggler_and_draws_every_rank_over_the_steps(
    page: Page, ui_stack: RunningStack
) -> None:
    spec: dict[str, Any] = run_spec(name="ui-straggler", workload="fail", steps=STEPS, batch_size=24)
    spec["workload"]["params"] = {"rank": 1, "slow_s": 0.08, "slow_in": "data_loading", "at_step": 20}
    response = ui_stack.client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    run_id = int(response.json()["id"])
    ui_stack.client.wait_status(run_id, {"succeeded"}, timeout=90)
    wait_for(
        lambda: (
            [r["steps"] for r in ui_stack.client.http.get(f"/api/v1/runs/{run_id}/stragglers").json()["ranks"]]
            == [STEPS, STEPS]
        ),
        30,
        "every step of both ranks",
        interval=0.3,
    )

    page.goto(f"/#/runs/{run_id}")
    card = page.get_by_test_id("stragglers")
    expect(page.get_by_test_id("stragglers-headline")).to_contain_text("rank 1: data loading +")
    expect(page.get_by_test_id("stragglers-headline")).to_contain_text("/step in all-reduce")
    expect(card.locator('tr[data-rank="1"] .tag')).to_have_text("straggler")
    # The Ranks table marks the rank the card names, and no other (it once marked its own "slowest")
    ranks = page.get_by_test_id("rank-table")
    expect(ranks.locator('tr[data-rank="1"] .tag')).to_have_text("straggler")
    expect(ranks.locator(".tag")).to_have_count(1)
    heatmap = page.get_by_test_id("heatmap")
    expect(heatmap).to_have_attribute("data-ranks", "2")
    expect(heatmap).to_have_attribute("data-columns", str(STEPS))

    page.get_by_test_id("heatmap-key").select_option("data_time_s")
    expect(page.get_by_test_id("heatmap-legend")).to_contain_text("ms")
    # the last column: rank 1 (the lower row) loads 80 ms a step, rank 0 under 1 ms
    green = page.wait_for_function(
        """() => {
          const c = document.querySelector('[data-testid="heatmap"]');
          const g = c.getContext('2d');
          const x = c.width - 2, row = c.height / 2;
          const top = g.getImageData(x, row / 2, 1, 1).data, bottom = g.getImageData(x, row * 1.5, 1, 1).data;
          return top[1] > 200 && bottom[1] < 100 ? [top[1], bottom[1]] : null;
        }"""
    ).json_value()
    assert green[0] > green[1]
    box = heatmap.bounding_box()
    assert box is not None
    heatmap.hover(position={"x": box["width"] - 2, "y": box["height"] * 0.75})
    expect(page.get_by_test_id("heatmap-hover")).to_contain_text(f"rank 1, step {STEPS}: ")

    expect(page.locator('[data-testid="events"] tr[data-alert="throughput"]')).to_contain_text("slower")
    expect(page.locator('[data-testid="events"] tr[data-alert="throughput"]')).to_contain_text(
        "below its moving baseline"
    )
    shot(page, "run-stragglers")
    card.screenshot(path=str(SHOTS / "run-stragglers-card.png"))
