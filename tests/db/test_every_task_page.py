"""``/dashboard/tasks/``: every task, filtered by status label, queue, path, keys, workflow, time and the
search; keyset pages whose statements read about a page of index entries (or a scan window for a
filter no index holds), whatever the table holds; a bad filter is a 400 page. The one search box's
``name:value`` tokens are redirected to those parameters (tasks/web/filter_box.py; its grammar:
tests/unit/test_filter_box.py), and the page's chips link to the query with one filter more or less."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.http import QueryDict
from django.test import Client
from django.utils import timezone

from tasks.models import Task
from tasks.web import all_tasks
from tasks.web.listings import SCAN_WINDOW
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
def test_the_boxs_tokens_redirect_to_the_parameters_they_name_and_filter_alike(staff: Client) -> None:
    ids = make_tasks()
    keyed = Task.objects.enqueue(
        "tests.testapp.handlers.echo", queue="mail box", rate_key="acme:eu", rate_limit=(1, 3600)
    ).id
    Task.objects.filter(pk=keyed).cancel()
    response = staff.get(
        "/dashboard/tasks/", {"q": 'queue:"mail box" status:Cancelled,failed rate_key:acme:eu', "before": "999999999"}
    )
    assert response.status_code == 302
    path, _, query = response["Location"].partition("?")
    assert path == "/dashboard/tasks/"
    assert QueryDict(query) == QueryDict(
        "before=999999999&status=Cancelled&status=failed&queue=mail+box&rate_key=acme%3Aeu"
    )
    assert shown(staff, query) == [keyed]
    # The rest of the box stays the search, as it was.
    location = staff.get("/dashboard/tasks/", {"q": f"status:Running {ids['stuck']}"})["Location"]
    assert QueryDict(location.partition("?")[2]) == QueryDict(f"status=Running&q={ids['stuck']}")
    assert shown(staff, location.partition("?")[2]) == [ids["stuck"]]
    # Without a token nothing moves: the search and an argument search are answered in place.
    assert staff.get("/dashboard/tasks/", {"q": "vm:4242:demo"}).status_code == 200
    refused = staff.get("/dashboard/tasks/", {"q": 'kwargs:{"queue": "mail"}'})
    assert refused.status_code == 400 and "needs its opt-in index" in refused.content.decode()


@pytest.mark.django_db(databases=["default", "second"])
@pytest.mark.usefixtures("routes")
def test_the_redirect_keeps_the_database_and_the_other_parameters(staff: Client) -> None:
    response = staff.get("/dashboard/tasks/?db=second&task_path=app.x&q=queue:mail+send_email")
    assert response.status_code == 302
    assert response["Location"] == "/dashboard/tasks/?db=second&task_path=app.x&q=send_email&queue=mail"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("token", "parameter"),
    [
        ("q=enqueued_after:yesterday", "enqueued_after=yesterday"),
        ("q=enqueued_before:2030-13-01T00:00:00Z", "enqueued_before=2030-13-01T00:00:00Z"),
        ("q=status:Pending+send_email", "status=Pending"),
        ("q=workflow:x", "workflow=x"),
        ("q=queue:" + "q" * 101, "queue=" + "q" * 101),
    ],
)
def test_a_bad_token_is_the_same_400_page_as_its_parameter(staff: Client, token: str, parameter: str) -> None:
    by_token, by_parameter = staff.get("/dashboard/tasks/?" + token), staff.get("/dashboard/tasks/?" + parameter)
    assert by_token.status_code == by_parameter.status_code == 400
    assert by_token.context["reason"] == by_parameter.context["reason"]


@pytest.mark.django_db
def test_an_open_quote_is_a_400_page_saying_so(staff: Client) -> None:
    response = staff.get("/dashboard/tasks/", {"q": 'queue:"mail box'})
    assert response.status_code == 400
    assert response.context["reason"] == 'q: the quoted value of queue: needs its closing " (then a space)'


@pytest.mark.django_db
def test_the_page_shows_the_filters_in_the_box_and_as_chips(staff: Client) -> None:
    make_tasks()
    response = staff.get("/dashboard/tasks/?status=failed&queue=mail+box&q=send_email&before=999999999")
    assert response.status_code == 200
    page = response.content.decode()
    assert response.context["box"] == 'status:Failed queue:"mail box" send_email'
    assert 'name="q" value="status:Failed queue:&quot;mail box&quot; send_email"' in page
    for name in ("queue", "task_path", "enqueued_after", "status"):
        assert f'name="{name}"' not in page  # one box, no input per filter
    status = {chip.key: chip for chip in response.context["status_chips"]}
    assert status["Failed"].on and not status["Ready"].on
    assert status["Failed"].href == "/dashboard/tasks/?queue=mail+box&q=send_email"
    assert status["Ready"].href == "/dashboard/tasks/?status=Failed&status=Ready&queue=mail+box&q=send_email"
    assert f'data-status="Ready" href="{status["Ready"].href.replace("&", "&amp;")}"' in page
    chips = {chip.key: chip.href for chip in response.context["filter_chips"]}
    assert chips == {
        "queue": "/dashboard/tasks/?status=failed&q=send_email",
        "q": "/dashboard/tasks/?status=failed&queue=mail+box",
    }
    assert 'data-filter="queue" href="/dashboard/tasks/?status=failed&amp;q=send_email"' in page
    assert "title='Finds a task by its id, its dedup key, the worker holding it" in page


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
