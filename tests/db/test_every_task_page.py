"""``/dashboard/tasks/``: every task, filtered by status label, queue, path, keys, workflow, time and the
search; keyset pages whose statements read about a page of index entries (or a scan window for a
filter no index holds), whatever the table holds; a bad filter is a 400 page."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from tasks.models import Task
from tasks.web import all_tasks
from tasks.web.queries import SCAN_WINDOW
from tests.db.test_dashboard import make_tasks
from tests.helpers.plans import add_rows, overreads, recorded

LIMIT = 50


def shown(staff: Client, query: dict[str, str] | str = "") -> list[int]:
    response = (
        staff.get("/dashboard/tasks/", query) if isinstance(query, dict) else staff.get("/dashboard/tasks/?" + query)
    )
    assert response.status_code == 200, response.content.decode()[-600:]
    return [task.pk for task in response.context["tasks"]]


@pytest.mark.django_db
def test_it_lists_every_task_newest_first_and_the_menu_goes_there(staff: Client) -> None:
    ids = make_tasks()
    assert shown(staff) == sorted(ids.values(), reverse=True)
    assert 'href="/dashboard/tasks/">Tasks</a>' in staff.get("/dashboard/").content.decode()


@pytest.mark.django_db
def test_each_filter_selects_what_it_names(staff: Client) -> None:
    ids = make_tasks()
    keyed = Task.objects.enqueue(
        "tests.testapp.handlers.echo", queue="mail", dedup_key="d-1", concurrency_key="c-1", concurrency_limit=5
    ).id
    workflow = Task.objects.get(pk=ids["awaiting"]).workflow_id
    assert shown(staff, {"status": "Failed"}) == [ids["failed"]]
    assert shown(staff, "status=Successful&status=cancelled") == sorted(
        [ids["succeeded"], ids["cancelled"]], reverse=True
    )
    assert set(shown(staff, {"status": "Ready"})) == {ids["pending"], ids["retrying"], ids["snoozed"], keyed}
    assert shown(staff, {"queue": "mail"}) == [keyed]
    assert shown(staff, {"task_path": "tests.testapp.handlers.echo"}) == [keyed]
    assert shown(staff, {"dedup_key": "d-1"}) == [keyed]
    assert shown(staff, {"concurrency_key": "c-1"}) == [keyed]
    assert shown(staff, {"concurrency_key": "dash", "status": "Blocked"}) == [ids["blocked"]]
    assert set(shown(staff, {"workflow": str(workflow)})) == {ids["awaiting"], ids["blocked"]}
    assert shown(staff, {"q": str(ids["stuck"])}) == [ids["stuck"]]
    assert shown(staff, {"q": "w1", "status": "Running"}) == [ids["stuck"], ids["running"]]  # stuck is Running too
    later = (timezone.now() + dt.timedelta(hours=1)).isoformat()
    assert shown(staff, {"enqueued_after": later}) == []
    assert len(shown(staff, {"enqueued_before": later})) == len(ids) + 1
    assert shown(staff, {"queue": "mail", "status": "Failed"}) == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("status=Pending", "status &#x27;Pending&#x27; is not one of"),
        ("status=stuck", "is not one of"),
        ("workflow=x", "workflow must be a whole number"),
        ("enqueued_after=yesterday", "enqueued_after must be a date and time"),
        # Read alike on every Python: basic format is read by 3.11+'s fromisoformat only.
        ("enqueued_after=20300101T100000Z", "enqueued_after must be a date and time"),
        ("enqueued_before=2030-13-01T00:00:00Z", "enqueued_before must be a date and time"),  # month 13
        ("before=-1", "before must be a whole number"),
        ("queue=" + "q" * 101, "queue must be at most 100 characters"),
        ('q=kwargs:{"a": 1}', "needs its opt-in index"),
    ],
)
def test_a_bad_filter_is_a_400_page_with_its_reason(staff: Client, query: str, reason: str) -> None:
    response = staff.get("/dashboard/tasks/?" + query)
    assert response.status_code == 400
    assert reason in response.content.decode()


@pytest.mark.django_db
def test_keyset_pages_walk_every_task_once(staff: Client) -> None:
    made = [Task.objects.enqueue("tests.testapp.handlers.noop", queue=f"q{i % 3}").id for i in range(7)]
    Task.objects.filter(pk__in=made[::2]).cancel()
    seen: list[int] = []
    before = ""
    for _ in range(10):
        page = all_tasks.page(all_tasks.Filters(), using="default", limit=3, before=int(before) if before else None)
        seen += [t.pk for t in page.tasks]
        if page.next_before is None:
            break
        before = str(page.next_before)
    assert seen == sorted(made, reverse=True)


@pytest.mark.django_db(transaction=True)
def test_its_statements_read_a_page_not_the_table() -> None:
    """History, then a burst of waiting and blocked tasks, not vacuumed: each filter's page reads about
    a page of index entries, or a scan window for the filters no index holds."""
    add_rows("bulk", "SUCCESSFUL", 6_000)
    # Each status several windows deep: a status smaller than that costs its own rows (a bitmap of it).
    add_rows("bulk", "FAILED", 3 * SCAN_WINDOW)
    add_rows("bulk", "CANCELLED", 3 * SCAN_WINDOW)
    add_rows("bulk", "READY", 4 * SCAN_WINDOW)
    add_rows("keyed", "READY", 4 * SCAN_WINDOW, keyed=True)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    filters = [
        all_tasks.Filters(),
        all_tasks.Filters(statuses=("SUCCESSFUL",)),
        all_tasks.Filters(statuses=("FAILED", "CANCELLED")),
        all_tasks.Filters(equal={"queue": "bulk"}),
        all_tasks.Filters(equal={"task_path": "app.jobs.x"}),
        all_tasks.Filters(equal={"concurrency_key": "keyed:k3"}),
        all_tasks.Filters(equal={"queue": "keyed", "concurrency_key": "keyed:k3"}),
        all_tasks.Filters(enqueued_after=timezone.now() - dt.timedelta(days=1)),
        all_tasks.Filters(search="app.jobs.x"),
    ]
    with recorded() as statements:
        for each in filters:
            page = all_tasks.page(each, using="default", limit=LIMIT, before=None)
            assert [t.pk for t in page.tasks] == sorted((t.pk for t in page.tasks), reverse=True)
            # A page, or a short one that says how far it looked (a filter checked within a window).
            assert page.tasks or page.scanned_to, each
    problems = overreads(statements, SCAN_WINDOW + 1)
    assert not problems, "\n".join(problems)
