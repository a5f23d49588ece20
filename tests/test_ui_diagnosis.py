"""The hang diagnosis on the run page, in a real browser against a real stack: a rank stuck in its data
loading is named after a click on Diagnose, then again by the watchdog when the stall ends the run,
with the diagnosis in the failure reason. Screenshots: test-output/screenshots/run-diagnosis*.png."""

from __future__ import annotations

from typing import Any

import pytest

from cli.wait import wait_for
from testkit.browser import SHOTS, browser_marks, shot, sync_api
from testkit.stack import RunningStack, run_spec

playwright_sync = sync_api()
Page = playwright_sync.Page
expect = playwright_sync.expect

pytestmark = browser_marks()


@pytest.mark.timeout(120)
def test_diagnose_names_the_stuck_rank_and_the_stall_keeps_its_diagnosis(page: Page, ui_stack: RunningStack) -> None:
    spec: dict[str, Any] = run_spec(name="ui-hang", workload="fail", steps=200, batch_size=24)
    spec["workload"]["params"] = {"at_step": 4, "hang": True, "rank": 1, "hang_in": "data_loading"}
    spec["training"]["stall_timeout_s"] = 20  # time to diagnose by hand first
    spec["training"]["max_attempts"] = 1
    run_id = _submit(ui_stack, spec)
    wait_for(lambda: ui_stack.client.run(run_id)["last_step"] >= 3, 60, "the run to reach its hang", interval=0.2)

    page.goto(f"/#/runs/{run_id}")
    card = page.get_by_test_id("diagnosis")
    expect(card).to_be_visible()
    headline = page.get_by_test_id("diagnosis-headline")

    def named() -> bool:
        button = page.get_by_test_id("diagnose")
        if button.is_enabled():
            button.click()
        expect(page.get_by_test_id("diagnosis-result")).not_to_have_attribute("data-status", "pending", timeout=15_000)
        return headline.inner_text().startswith("rank 1 never entered all_reduce #")

    wait_for(named, 40, "the diagnosis to name rank 1", interval=0.5)
    expect(headline).to_contain_text("rank 1 is at workloads.py:")
    expect(page.locator('[data-testid="diagnosis-ranks"] tr[data-rank="1"]')).to_have_attribute("data-state", "python")
    page.get_by_test_id("diagnosis-stack-1").locator("summary").click()
    expect(page.get_by_test_id("diagnosis-stack-1")).to_contain_text("in __getitems__")
    href = page.get_by_test_id("diagnosis-dumps").get_attribute("href")
    assert href == f"/api/v1/runs/{run_id}/diagnosis/dumps"
    shot(page, "run-diagnosis")
    card.screenshot(path=str(SHOTS / "run-diagnosis-card.png"))

    ui_stack.client.wait_status(run_id, {"failed"}, timeout=60)
    page.goto(f"/#/runs/{run_id}?r=failed")
    expect(page.get_by_test_id("diagnosis-result")).to_contain_text("Asked by the watchdog (stall)")
    expect(page.get_by_test_id("diagnosis-headline")).to_contain_text("rank 1 never entered all_reduce #")
    expect(page.get_by_test_id("diagnose")).to_have_count(0)  # a run that ended cannot be asked
    expect(page.locator(".reason")).to_contain_text("; diagnosis: rank 1 never entered all_reduce #")
    shot(page, "run-diagnosis-stalled")
    page.locator(".reason").screenshot(path=str(SHOTS / "run-diagnosis-stalled-reason.png"))


def _submit(stack: RunningStack, spec: dict[str, Any]) -> int:
    response = stack.client.http.post("/api/v1/runs", json=spec)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])
