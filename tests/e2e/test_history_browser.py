"""A person at the history page: its four charts render in Chromium with the rolled-up hours, and the
queue filter narrows them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tasks.maintenance.history import roll_up_hours
from tests.db.test_history import finished, hour_ago
from tests.e2e.test_dashboard_browser import log_in

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.slow]


def rendered(page: Any, selector: str) -> list[dict[str, float]]:
    """The boxes the browser laid out for the elements matching ``selector`` (zero-sized ones left out)."""
    boxes: list[dict[str, float]] = page.eval_on_selector_all(
        selector,
        "els => els.map(e => e.getBoundingClientRect()).filter(r => r.width > 0 && r.height > 0)"
        ".map(r => ({x: r.x, y: r.y, width: r.width, height: r.height}))",
    )
    return boxes


def test_the_history_charts_render_with_data_and_filter_by_queue(
    browser_page: Any, live_server: Any, tmp_path: Path
) -> None:
    # Six hours of finished tasks in two queues: mail succeeds quickly, reports run long and fail often.
    for ago in range(2, 8):
        for i in range(ago):
            finished(hour_ago(ago), queue="mail", path="app.mail.send", run=0.05 * (i + 1), wait=0.2, at_minute=i)
        finished(hour_ago(ago), queue="reports", path="app.reports.build", run=40.0, wait=3.0, status="FAILED")
        finished(hour_ago(ago), queue="reports", path="app.reports.build", run=25.0, wait=1.0, failures=1)
    roll_up_hours()

    page = browser_page
    log_in(page, live_server)
    page.click("header a:text('History')")
    page.wait_for_url(f"{live_server.url}/dashboard/history/")
    assert page.locator("h1").inner_text() == "History"

    charts = page.locator("svg.history-chart")
    assert charts.count() == 4
    for i in range(4):
        box = charts.nth(i).bounding_box()
        assert box is not None and box["width"] > 600 and box["height"] > 100
        assert charts.nth(i).get_attribute("data-empty") == "false"
    # Throughput: a stack per hour of succeeded and failed bars, laid out with a height.
    succeeded = rendered(page, "svg.history-chart >> nth=0 >> rect.bar[data-series=succeeded]")
    assert len(succeeded) == 6
    assert len(rendered(page, "svg.history-chart >> nth=0 >> rect.bar[data-series=failed]")) == 6
    # The busiest hour (7 hours ago: 7 mail tasks and 2 reports) has the tallest stack.
    heights = [box["height"] for box in succeeded]
    assert heights[0] == max(heights)
    # Wait and run percentiles: one line per percentile, a dot per hour.
    for nth in (2, 3):
        for name in ("p50", "p95", "p99"):
            assert len(rendered(page, f"svg.history-chart >> nth={nth} >> circle.dot[data-series={name}]")) == 6
            assert rendered(page, f"svg.history-chart >> nth={nth} >> polyline[data-series={name}]")
    assert page.locator("#history-keys tbody tr").count() == 2
    page.screenshot(path=str(Path(os.environ.get("HISTORY_SCREENSHOT", tmp_path / "history.png"))), full_page=True)

    # Filter by queue: only the reports' hours remain, one success and one failure each.
    page.select_option("select[name=queue]", "reports")
    page.click("#history-filter button")
    page.wait_for_url("**/dashboard/history/?queue=reports*")
    assert page.locator("#history-keys tbody tr").count() == 1
    tooltips = page.eval_on_selector_all(
        "svg.history-chart >> nth=0 >> rect.bar title", "els => els.map(e => e.textContent)"
    )
    assert len(tooltips) == 12
    assert all(text.endswith(": 1") for text in tooltips)
    run_p50 = page.eval_on_selector_all(
        "svg.history-chart >> nth=3 >> circle.dot[data-series=p50] title", "els => els.map(e => e.textContent)"
    )
    # Per hour, the runs 25 s and 40 s, both in [20, 50): p50 is rank 1 of 2, halfway into [20, 40].
    assert all(text.endswith("p50: 30 s") for text in run_p50), run_p50
