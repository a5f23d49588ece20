"""The datasets page, in a real browser against a real stack: a dataset made with the CLI's code
shows its samples, shards, size and typed fields. Screenshot: test-output/screenshots/datasets.png."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.browser import browser_marks, shot, sync_api
from testkit.datasets import classification_files, make_dataset
from testkit.stack import RunningStack

playwright_sync = sync_api()
Page = playwright_sync.Page
expect = playwright_sync.expect

pytestmark = browser_marks()


@pytest.mark.timeout(120)
def test_the_datasets_page_lists_a_dataset_with_its_fields(page: Page, ui_stack: RunningStack, tmp_path: Path) -> None:
    make_dataset(ui_stack.url, ui_stack.token, "ui-vectors", [classification_files(tmp_path, 120, input_dim=8)], 16384)
    page.get_by_role("link", name="Datasets").click()
    row = page.get_by_test_id("dataset-ui-vectors")
    expect(row).to_contain_text("ready")
    expect(row).to_contain_text("120")
    expect(row).to_contain_text("input.npy <f4[8]")
    expect(row).to_contain_text("cls")
    shards = ui_stack.client.http.get("/api/v1/datasets/ui-vectors").json()["shards"]
    assert shards >= 2
    expect(row.locator("td").nth(3)).to_have_text(str(shards))
    shot(page, "datasets")
