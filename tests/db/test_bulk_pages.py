"""The bulk operations of the dashboard and the admin: a form (or an admin action on the list's
filters) inserts an operation and nothing else; its page shows the progress the leader makes; a
refused form writes nothing; cancel is a POST."""

from __future__ import annotations

import html
import re

import pytest
from django.db import connection
from django.test import Client

from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Task
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN = "/admin/tasks/task/"


def failed(count: int, queue: str = "default") -> list[int]:
    ids = Task.objects.bulk_enqueue(NOOP, ({"customer": i % 2} for i in range(count)), queue=queue)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET status = 'FAILED', finished_at = clock_timestamp() WHERE id = ANY(%s)", [ids]
        )
    return ids


def test_the_form_requests_an_operation_whose_page_shows_its_progress(staff: Client) -> None:
    ids = failed(10)
    response = staff.post(
        "/dashboard/tasks/bulk/",
        {"kind": "retry", "status": ["FAILED"], "queue": "default", "kwargs_contains": '{"customer": 1}'},
    )
    operation = BulkOperation.objects.get()
    assert response.status_code == 302 and response["Location"].endswith(f"/dashboard/tasks/bulk/{operation.pk}/")
    assert operation.filter == {"status": ["FAILED"], "queue": "default", "kwargs_contains": {"customer": 1}}
    page = staff.get(f"/dashboard/tasks/bulk/{operation.pk}/").content.decode()
    assert 'id="bulk-status">PENDING' in page and 'id="bulk-cancel"' in page
    BulkRunner().run_until_idle()
    page = staff.get(f"/dashboard/tasks/bulk/{operation.pk}/").content.decode()
    assert 'id="bulk-status">DONE' in page and 'id="bulk-changed">5<' in page and 'id="bulk-cancel"' not in page
    assert Task.objects.filter(pk__in=ids, status="READY").count() == 5
    listing = staff.get("/dashboard/tasks/bulk/").content.decode()
    assert f'data-operation="{operation.pk}"' in listing


def test_a_refused_form_writes_nothing(staff: Client) -> None:
    for data in (
        {"kind": "retry", "status": ["RUNNING"]},
        {"kind": "explode"},
        {"kind": "retry", "kwargs_contains": "{not json"},
        {"kind": "cancel", "workflow_id": "x"},
        {"kind": "retry", "finished_after": "yesterday"},
    ):
        response = staff.post("/dashboard/tasks/bulk/", data)
        assert response.status_code == 200 and "Nothing requested" in response.content.decode(), data
    assert not BulkOperation.objects.exists()


def test_cancel_is_a_post_and_a_second_one_says_it_ended(staff: Client) -> None:
    failed(3)
    operation = BulkOperation.objects.request("retry", {})
    assert staff.get(f"/dashboard/tasks/bulk/{operation.pk}/cancel/").status_code == 405
    staff.post(f"/dashboard/tasks/bulk/{operation.pk}/cancel/")
    operation.refresh_from_db()
    assert operation.status == "CANCELLED"
    page = staff.post(f"/dashboard/tasks/bulk/{operation.pk}/cancel/", follow=True).content.decode()
    assert "is already cancelled" in page
    assert staff.get("/dashboard/tasks/bulk/999999/").status_code == 404


def test_a_task_list_links_to_a_bulk_action_on_all_matching(staff: Client) -> None:
    failed(2, queue="mail")
    page = staff.get("/dashboard/tasks/failed/", {"queue": "mail"}).content.decode()
    assert 'id="bulk-all-matching" href="/dashboard/tasks/bulk/?status=Failed&amp;queue=mail"' in page
    assert 'id="bulk-all-matching"' not in staff.get("/dashboard/tasks/running/").content.decode()
    # The bulk form takes the pages' labels: the link ticks "Failed", and the form posts it.
    form = staff.get("/dashboard/tasks/bulk/", {"status": "Failed", "queue": "mail"}).content.decode()
    assert '<input type="checkbox" name="status" value="Failed" checked> Failed' in form
    assert 'value="FAILED"' not in form
    staff.post("/dashboard/tasks/bulk/", {"kind": "retry", "status": "Failed", "queue": "mail"})
    assert BulkOperation.objects.get().filter == {"status": ["FAILED"], "queue": "mail"}


def test_the_admin_action_applies_to_the_lists_filters_not_the_selection(staff: Client) -> None:
    mail = failed(4, queue="mail")
    other = failed(3)
    response = staff.post(
        f"{ADMIN}?status__exact=FAILED&queue__exact=mail",
        {"action": "retry_all_matching", "_selected_action": [mail[0]]},
        follow=True,
    )
    assert "requested for every task matching" in response.content.decode()
    operation = BulkOperation.objects.get()
    assert operation.filter == {"status": ["FAILED"], "queue": "mail"}
    BulkRunner().run_until_idle()
    assert Task.objects.filter(pk__in=mail, status="READY").count() == 4
    assert Task.objects.filter(pk__in=other, status="FAILED").count() == 3

    refused = staff.post(
        f"{ADMIN}?lease=stuck", {"action": "cancel_all_matching", "_selected_action": [mail[0]]}, follow=True
    ).content.decode()
    assert "Nothing requested" in refused
    wrong = staff.post(
        f"{ADMIN}?status__exact=RUNNING", {"action": "discard_all_matching", "_selected_action": [mail[0]]}, follow=True
    ).content.decode()
    assert "Nothing requested" in wrong
    assert BulkOperation.objects.count() == 1


def bulk_hint(staff: Client, tab: str, **query: str) -> str:
    """The text of a task list's hint that links to the bulk page."""
    page = staff.get(f"/dashboard/tasks/{tab}/", query).content.decode()
    (hint,) = [p for p in re.findall(r"<p[^>]*>(.*?)</p>", page, re.S) if 'id="bulk-all-matching"' in p]
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", hint)).split())


def test_each_tab_s_bulk_hint_names_the_tab_s_state_and_what_a_bulk_operation_takes(staff: Client) -> None:
    from tasks.web.dashboard import state_label

    offered = {"pending": "Cancel or discard", "awaiting": "Cancel or discard", "blocked": "Cancel or discard"}
    offered |= {"succeeded": "Retry", "failed": "Retry", "cancelled": "Retry"}
    for tab, kinds in offered.items():
        assert bulk_hint(staff, tab).startswith(f"{kinds} every {state_label(tab)} task, not only this page"), tab
    # A view is no status: a bulk operation filters by status, so the hint says it takes every Ready task.
    for tab in ("retrying", "snoozed"):
        hint = bulk_hint(staff, tab, queue="mail")
        assert hint.startswith(f"A bulk operation cannot take the {state_label(tab)} tasks alone"), hint
        assert "every Ready task of this queue" in hint and f"({state_label(tab)} or not)" in hint, hint
