"""A person at the dashboard: log in, read the overview, watch work finish live, stop the generator."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from tasks.demo import generator
from tasks.models import Failure, Task

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.slow]


def log_in(page: Any, live_server: Any) -> None:
    get_user_model().objects.create_user("ops", password="correct horse", is_staff=True, is_superuser=True)
    page.goto(f"{live_server.url}/dashboard/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_url(f"{live_server.url}/dashboard/")


def card(page: Any, state: str) -> Any:
    return page.locator(f"#task-counts a[data-state={state}] .n")


def test_log_in_watch_a_task_finish_live_and_stop_the_generator(
    browser_page: Any, live_server: Any, processes: Any
) -> None:
    page = browser_page
    log_in(page, live_server)
    assert page.locator("h1").inner_text().endswith("Overview")
    assert card(page, "succeeded").inner_text() == "0"

    task_id = Task.objects.enqueue("tests.testapp.handlers.noop").id
    page.evaluate("window.__noReload = 'still here'")
    page.wait_for_function("document.querySelector('#task-counts a[data-state=pending] .n').innerText === '1'")

    processes("run_worker", "--poll-interval", "0.2", "--ttl", "5")
    page.wait_for_function("document.querySelector('#task-counts a[data-state=succeeded] .n').innerText === '1'")
    assert card(page, "pending").inner_text() == "0"
    assert page.evaluate("window.__noReload") == "still here", "the page reloaded instead of refreshing in place"
    assert Task.objects.get(pk=task_id).status == "SUCCESSFUL"

    generator.set_state(running=True, rate=5)
    processes("run_generator", "--ttl", "2", "--tick", "0.1")
    page.goto(f"{live_server.url}/dashboard/generator/")
    page.wait_for_function("!document.querySelector('#generator-leader').innerText.startsWith('none')")
    page.wait_for_function("document.querySelector('#generator-observed').innerText === 'running'")
    page.click("#generator-stop")
    page.wait_for_url(f"{live_server.url}/dashboard/generator/")
    assert page.locator("#generator-desired").inner_text() == "stopped"
    assert generator.status().running is False
    # The leader (another process) picks the change up from the database; the page shows it live.
    page.wait_for_function("document.querySelector('#generator-observed').innerText === 'stopped'")


def seed_an_hour_of_history() -> None:
    """Tasks in every state, finished over the last hour, for a screenshot worth looking at."""
    now = timezone.now()
    ids = Task.objects.bulk_enqueue("tasks.demo.sleep", ({"sleep_duration_seconds": 1} for _ in range(900)))
    claimed = Task.objects.claim("vm:4242:demo", limit=860, ttl=60)
    done = claimed[:780]
    Task.objects.complete_many("vm:4242:demo", [(c.id, c.token, '{"slept": 1}') for c in done])
    failures = [
        Failure(c.id, c.token, "builtins.TimeoutError", "upstream timed out", "", retry=False) for c in claimed[780:800]
    ]
    Task.objects.fail_many("vm:4242:demo", failures)
    for offset, task_id in enumerate(ids[:800]):
        minute = now - dt.timedelta(minutes=59 - (offset * 60) // 800, seconds=offset % 50)
        Task.objects.filter(pk=task_id).update(finished_at=minute)
    Task.objects.filter(pk__in=[c.id for c in claimed[800:806]]).update(expires_at=now - dt.timedelta(seconds=4))
    Task.objects.recover_expired()
    from leasing.models import Lease
    from tasks.models import Worker

    for name in ("reports:daily", "billing:sync", "scheduler"):
        Lease.objects.acquire(name, "vm:4242:demo", ttl=120)
    Lease.objects.renew("scheduler", "vm:4242:demo", Lease.objects.get(resource="scheduler").token, ttl=120)
    Lease.objects.acquire("cache:warm", "vm:17:gone", ttl=0.01)
    Worker.objects.create(id="vm:4242:demo", hostname="vm", pid=4242, queues=["default"], concurrency=4, running=54)


def test_overview_screenshot(browser_page: Any, live_server: Any, tmp_path: Path) -> None:
    """The overview of a seeded hour, screenshotted to the test's directory (or ``$SCREENSHOT_TO``).
    docs/dashboard.png comes from the demo's walk (tests/e2e/test_demo_walk.py), not from here."""
    page = browser_page
    seed_an_hour_of_history()
    generator.set_state(running=True, rate=2)
    log_in(page, live_server)
    assert int(card(page, "succeeded").inner_text().replace(",", "")) == 780
    assert page.locator("svg.chart rect").count() > 30
    target = Path(os.environ.get("SCREENSHOT_TO") or tmp_path / "dashboard.png")
    page.screenshot(path=str(target), full_page=True)
    assert target.stat().st_size > 10_000


def test_the_workflows_page_and_a_workflows_page_show_its_members_by_status(
    browser_page: Any, live_server: Any
) -> None:
    from tasks.workflows import group, step

    name = "nightly-report-" + "n" * 185  # the longest name a workflow may have, without a space
    done = group(
        [step("tests.testapp.handlers.noop", n=n) for n in range(3)],
        then=step("tests.testapp.handlers.noop"),
        name=name,
    ).enqueue()
    (first,) = Task.objects.claim("w-e2e", limit=1)
    Task.objects.complete_many("w-e2e", [(first.id, first.token, "null")])

    page = browser_page
    log_in(page, live_server)
    page.click("header >> text=Workflows")
    page.wait_for_url(f"{live_server.url}/dashboard/workflows/")
    row = page.locator(f"#workflows tr[data-workflow='{done.id}']")
    assert name in row.inner_text()
    assert "1 successful · 0 failed · 3 remaining of 4" in row.inner_text()
    assert page.evaluate("document.scrollingElement.scrollWidth <= document.scrollingElement.clientWidth")

    row.locator(f"a[href^='/dashboard/workflows/{done.id}/']").click()
    page.wait_for_url(f"{live_server.url}/dashboard/workflows/{done.id}/")

    def count(status: str) -> str:
        return str(page.locator(f"#member-counts a[data-status={status}] .n").inner_text())

    assert (count("SUCCESSFUL"), count("READY"), count("AWAITING"), count("FAILED")) == ("1", "2", "1", "0")
    assert page.locator("#members tbody tr").count() == 4
    assert page.evaluate("document.scrollingElement.scrollWidth <= document.scrollingElement.clientWidth")

    # The page refreshes in place: a member finishing elsewhere shows up without a reload.
    for task in Task.objects.claim("w-e2e", limit=2):
        Task.objects.complete_many("w-e2e", [(task.id, task.token, "null")])
    page.wait_for_function("document.querySelector('#member-counts a[data-status=SUCCESSFUL] .n').innerText === '3'")
    assert count("READY") == "1" and count("AWAITING") == "0"  # the callback was released

    page.click("#workflow-cancel")
    page.wait_for_url(f"{live_server.url}/dashboard/workflows/{done.id}/")
    assert page.locator("#workflow-status").inner_text() == "Cancelled"
    assert count("CANCELLED") == "1"


def failed_in(queue: str, n: int) -> list[int]:
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", ({} for _ in range(n)), queue=queue)
    claimed = Task.objects.claim("w-e2e", limit=n, queues=[queue])
    Task.objects.fail_many(
        "w-e2e", [Failure(c.id, c.token, "builtins.ValueError", "no", "", retry=False) for c in claimed]
    )
    return ids


def test_the_tasks_page_filters_from_one_box_and_its_chips(browser_page: Any, live_server: Any) -> None:
    """Typed into the one box, ``queue:X status:Failed`` becomes the page's filters, shown as chips;
    the queue chip's remove link takes that filter away alone, and the list still refreshes in place."""
    mail_failed = failed_in("mail", 2)
    other_failed = failed_in("other", 1)
    mail_ready = Task.objects.enqueue("tests.testapp.handlers.noop", queue="mail").id

    page = browser_page
    log_in(page, live_server)
    page.goto(f"{live_server.url}/dashboard/tasks/")

    def rows() -> set[int]:
        return {int(pk) for pk in page.locator("#tasks tbody tr").evaluate_all("rs => rs.map(r => r.dataset.task)")}

    assert rows() == {*mail_failed, *other_failed, mail_ready}
    removable = ["Failed \N{MULTIPLICATION SIGN}", "queue:mail \N{MULTIPLICATION SIGN}"]
    page.get_by_label("Search", exact=True).fill("queue:mail status:Failed")
    page.keyboard.press("Enter")
    page.wait_for_url(f"{live_server.url}/dashboard/tasks/?queue=mail&status=Failed")
    assert rows() == set(mail_failed)
    assert page.locator("#task-search-box").input_value() == "status:Failed queue:mail"
    assert page.locator("#task-chips a.chip.on").all_inner_texts() == removable
    assert page.locator("#task-chips a[data-status=Ready]").get_attribute("class") == "chip"

    page.get_by_role("link", name="Remove queue:mail").click()
    page.wait_for_url(f"{live_server.url}/dashboard/tasks/?status=Failed")
    assert rows() == {*mail_failed, *other_failed}
    assert page.locator("#task-chips a.chip.on").all_inner_texts() == removable[:1]
    assert page.locator("#task-search-box").input_value() == "status:Failed"

    # The live refresh still swaps the list in place under the chips.
    page.evaluate("window.__noReload = 'still here'")
    (late,) = failed_in("late", 1)
    page.wait_for_selector(f"#tasks tr[data-task='{late}']")
    assert page.evaluate("window.__noReload") == "still here"

    page.get_by_role("link", name="Failed: remove from the status filter").click()
    page.wait_for_url(f"{live_server.url}/dashboard/tasks/")
    assert rows() == {*mail_failed, *other_failed, mail_ready, late}
    assert page.locator("#task-chips a.chip.on").count() == 0
