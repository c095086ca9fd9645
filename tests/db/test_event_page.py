"""Durable events on the task page (issue 58): what a task waits for and the events sent to it, and
the page's "Send event" form (``send_event``, as ``POST /api/tasks/<id>/events`` does). A bad name or
payload is a 400 page, a finished task or a name sent before a 409 page, a staff user without the
change permission a 403: none of them stores anything. Payloads are redacted as arguments are."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from tasks.exceptions import Snooze
from tasks.models import Task, TaskEvent
from tasks.runtime import _set_current
from tasks.steps import wait_for_event
from tests.db.test_steps import attempt
from tests.factories import StaffFactory

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "steps"


def suspended(name: str, timeout: float | None) -> int:
    """A task whose attempt began ``wait_for_event(name)`` and was suspended (snoozed) by it."""
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    _set_current(attempt(task_id, "w1"))
    try:
        with pytest.raises(Snooze):
            wait_for_event(name, timeout=timeout)
    finally:
        _set_current(None)
    # What the worker does with the snooze: the task waits, unheld, until its wake.
    Task.objects.filter(pk=task_id).update(
        status="READY", holder=None, expires_at=None, run_after=timezone.now() + dt.timedelta(hours=1)
    )
    return task_id


def events(task_id: int) -> list[tuple[str, Any]]:
    return list(TaskEvent.objects.filter(task_id=task_id).order_by("id").values_list("name", "payload"))


def test_the_page_names_the_awaited_event_and_its_form_sends_it_once(staff: Client) -> None:
    task_id = suspended("approved", timeout=3600)
    page = f"/dashboard/tasks/{task_id}/"
    html = staff.get(page).content.decode()
    assert 'id="awaited"' in html and ">approved</span> until" in html
    assert 'name="name" required maxlength="150" size="20" value="approved"' in html, "the one awaited name"
    sent = staff.post(f"{page}events/", {"name": "approved", "payload": '{"by": "ops", "n": 2}'})
    assert (sent.status_code, sent["Location"]) == (302, page)
    assert events(task_id) == [("approved", {"by": "ops", "n": 2})]
    task = Task.objects.get(pk=task_id)
    assert task.status == "READY" and task.run_after <= timezone.now(), "the send woke it: due at once"
    again = staff.post(f"{page}events/", {"name": "approved", "payload": '"later"'})
    assert again.status_code == 409 and "the first payload stands" in again.content.decode()
    assert events(task_id) == [("approved", {"by": "ops", "n": 2})]
    html = staff.get(page).content.decode()
    assert 'data-event="approved"' in html and "&quot;by&quot;: &quot;ops&quot;" in html
    assert 'id="awaited"' in html, "still suspended until its next attempt takes the event"


@pytest.mark.parametrize(
    ("form", "reason"),
    [
        ({"name": "", "payload": "1"}, "non-empty string"),
        ({"name": " ", "payload": "1"}, "non-empty string"),
        ({"name": "a\x00b", "payload": "1"}, "must not contain NUL"),
        ({"name": "x" * 151, "payload": "1"}, "non-empty string"),
        ({"name": "approved", "payload": "{"}, "payload must be JSON"),
        ({"name": "approved", "payload": "NaN"}, "payload must be JSON"),
        ({"name": "approved", "payload": "[Infinity]"}, "payload must be JSON"),
        ({"name": "approved", "payload": '"a\\u0000b"'}, "cannot be stored"),
    ],
)
def test_bad_names_and_payloads_are_400_and_store_nothing(staff: Client, form: dict[str, str], reason: str) -> None:
    task_id = suspended("approved", timeout=None)
    refused = staff.post(f"/dashboard/tasks/{task_id}/events/", form)
    assert refused.status_code == 400 and reason in refused.content.decode(), refused.content.decode()[-500:]
    assert events(task_id) == []
    assert Task.objects.get(pk=task_id).run_after > timezone.now(), "still suspended"


def test_an_empty_payload_is_null_and_an_event_may_come_before_its_wait(staff: Client) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    page = f"/dashboard/tasks/{task_id}/"
    html = staff.get(page).content.decode()
    assert 'id="send-event"' in html and 'id="awaited"' not in html
    assert staff.post(f"{page}events/", {"name": "early", "payload": "  "}).status_code == 302
    assert events(task_id) == [("early", None)]


def test_a_finished_or_missing_task_takes_no_event_and_a_viewer_may_not_send(staff: Client) -> None:
    task_id = suspended("approved", timeout=None)
    viewer = Client()
    viewer.force_login(StaffFactory.create(is_superuser=False))  # staff without the change permission
    assert viewer.post(f"/dashboard/tasks/{task_id}/events/", {"name": "approved"}).status_code == 403
    Task.objects.filter(pk=task_id).update(status="CANCELLED", finished_at=timezone.now())
    html = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    assert 'id="send-event"' not in html and 'id="awaited"' not in html, "a finished task waits for nothing"
    refused = staff.post(f"/dashboard/tasks/{task_id}/events/", {"name": "approved", "payload": "1"})
    assert refused.status_code == 409 and "cancelled" in refused.content.decode()
    assert staff.post(f"/dashboard/tasks/{task_id + 1000}/events/", {"name": "x"}).status_code == 404
    assert events(task_id) == []


def test_payloads_are_redacted_as_arguments_are(staff: Client, settings: Any) -> None:
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "REDACT_ARGUMENTS": ["password"]}
    task_id = suspended("login", timeout=None)
    staff.post(f"/dashboard/tasks/{task_id}/events/", {"name": "login", "payload": '{"password": "hunter2"}'})
    html = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    assert 'data-event="login"' in html and "hunter2" not in html and "[redacted]" in html


def test_metrics_count_the_events_no_waiting_task_was_woken_for(client: Client, settings: Any) -> None:
    from leasing.metrics import scrape_values
    from tasks.steps import send_event

    settings.LEASING_METRICS_PUBLIC = True
    waiting = suspended("approved", timeout=None)
    assert send_event(waiting, "approved", 1)  # woke it: delivered
    elsewhere = suspended("approved", timeout=None)
    assert send_event(elsewhere, "other", 2)  # it waits for another name
    early = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    assert send_event(early, "approved", 3)  # not at its wait yet
    values = scrape_values(client.get("/metrics").content.decode())
    assert values['tasks_events_undelivered{database="default"}'] == 2
