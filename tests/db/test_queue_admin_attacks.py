"""Hostile requests to the queue switches' admin (tasks/admin.py QueueControlAdmin): names PostgreSQL
cannot store or the column cannot hold, hostile ``?db=`` and ``_changelist_filters``, and a pause that
cannot get its lock. Each is refused with a form error, a message or a 400, never a 5xx, and a
refused request changes nothing in either database."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from django.test import Client

from tasks.models import QueueControl, Task
from tests.helpers import test_database_url as database_url

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "second"])

NOOP = "tests.testapp.handlers.noop"
ADD = "/admin/tasks/queuecontrol/add/"
LIST = "/admin/tasks/queuecontrol/"


@pytest.fixture(autouse=True)
def routes(settings: Any) -> None:
    settings.LEASING_TASKS = {"QUEUE_DATABASES": {"reports": "second"}}


def no_switches() -> bool:
    return not QueueControl.objects.using("default").exists() and not QueueControl.objects.using("second").exists()


@pytest.mark.parametrize("db", ["", "?db=second"])
@pytest.mark.parametrize("name", ["mail\x00", "reports\x00", "x" * 101, "r" * 100 + "s", "   ", ""])
def test_a_name_no_column_can_hold_is_a_form_error(admin_client: Client, db: str, name: str) -> None:
    response = admin_client.post(ADD + db, {"name": name, "paused": "on"})
    assert response.status_code == 200, response.status_code
    assert response.context["adminform"].form.errors
    assert no_switches()


@pytest.mark.parametrize(
    "filters",
    ["db=%00", "db=second&db=default", "db=nowhere", "db=" + "x" * 5000, "db=second%0A", "db=%ED%A0%80"],
)
def test_a_hostile_changelist_filter_is_a_400_that_writes_nothing(admin_client: Client, filters: str) -> None:
    url = f"{ADD}?_changelist_filters={quote(filters)}"
    assert admin_client.get(url).status_code == 400
    assert admin_client.post(url, {"name": "reports", "paused": "on"}).status_code == 400
    assert no_switches()


def test_the_filters_name_the_database_a_switch_is_added_to(admin_client: Client) -> None:
    """The add page opened from the list of the second database (its filters carried along) adds the
    routed queue's switch there; a ``db`` in the query string wins over the filters."""
    carried = f"{ADD}?_changelist_filters={quote('db=second')}"
    assert admin_client.post(carried, {"name": "reports", "paused": "on"}).status_code == 302
    assert QueueControl.objects.using("second").get(name="reports").paused
    both = f"{ADD}?db=default&_changelist_filters={quote('db=second')}"
    refused = admin_client.post(both, {"name": "reports", "paused": "on", "reason": "again"})
    assert refused.status_code == 200 and b"lives in database" in refused.content
    assert QueueControl.objects.using("second").get(name="reports").reason == ""
    assert not QueueControl.objects.using("default").exists()


@pytest.fixture
def reader() -> Any:
    """An open transaction that has read the queue switches (an application's, a claim held up by a
    row lock): a pause waits for it, for a bounded time."""
    with psycopg.connect(database_url().replace("postgres://", "postgresql://", 1)) as conn:
        conn.execute("SELECT count(*) FROM tasks_queuecontrol")
        yield conn
        conn.rollback()


def test_a_pause_from_the_add_form_that_cannot_get_its_lock_is_a_message(
    admin_client: Client, monkeypatch: Any, reader: Any
) -> None:
    import tasks.models

    monkeypatch.setattr(tasks.models, "PAUSE_LOCK_TIMEOUT_MS", 200)
    Task.objects.enqueue(NOOP, queue="mail")
    response = admin_client.post(ADD, {"name": "mail", "paused": "on"}, follow=True)
    assert response.status_code == 200
    shown = [str(m) for m in response.context["messages"]]
    assert any("could not pause 'mail'" in m for m in shown), shown
    assert not any("added successfully" in m for m in shown), shown
    reader.rollback()
    assert no_switches()
    from django.contrib.admin.models import LogEntry

    assert not LogEntry.objects.exists()  # nothing recorded as added
    assert len(Task.objects.claim("w1", queues=["mail"])) == 1


def test_a_pause_action_that_cannot_get_its_lock_is_a_message(
    admin_client: Client, monkeypatch: Any, reader: Any
) -> None:
    import tasks.models

    QueueControl.objects.resume("mail")
    reader.rollback()
    reader.execute("SELECT count(*) FROM tasks_queuecontrol")
    monkeypatch.setattr(tasks.models, "PAUSE_LOCK_TIMEOUT_MS", 200)
    response = admin_client.post(LIST, {"action": "pause", "_selected_action": ["mail"]}, follow=True)
    assert response.status_code == 200
    shown = [str(m) for m in response.context["messages"]]
    assert any("could not pause 'mail'" in m for m in shown), shown
    assert not any("Paused 1" in m for m in shown), shown
    reader.rollback()
    assert not QueueControl.objects.get(name="mail").paused
