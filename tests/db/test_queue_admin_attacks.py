"""Hostile requests to the queue switches' admin (tasks/admin/workers.py QueueControlAdmin): names PostgreSQL
cannot store or the column cannot hold, hostile ``?db=`` and ``_changelist_filters``, and a pause that
cannot get its lock. Each is refused with a form error, a message or a 400, never a 5xx, and a
refused request changes nothing in either database."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from django.test import Client

from tasks.backends.placement import misrouted
from tasks.models import QueueControl, Task
from tests.helpers import test_database_url as database_url
from tests.helpers.api import check_answer
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "second"])

ADD = "/admin/tasks/queuecontrol/add/"
LIST = "/admin/tasks/queuecontrol/"


@pytest.fixture(autouse=True)
def reports_in_second_database(settings: Any) -> None:
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


@pytest.fixture
def pinned(settings: Any) -> None:
    """A django.tasks backend pinned to the second database takes the queue ``mail``: its tasks live
    there, and its workers (``run_worker --backend pinned``, or ``--database second --queues mail``)
    claim there, although ``mail`` is not routed (QUEUE_DATABASES sends it to default)."""
    settings.TASKS = {
        "default": {"BACKEND": "tasks.backends.LeaseBackend", "QUEUES": []},
        "pinned": {"BACKEND": "tasks.backends.LeaseBackend", "QUEUES": ["mail"], "OPTIONS": {"database": "second"}},
    }


def test_a_queue_a_pinned_backend_takes_is_paused_where_its_workers_claim(admin_client: Client, pinned: None) -> None:
    from tests.conformance.lease_tasks import echo

    result = echo.using(backend="pinned", queue_name="mail").enqueue("hi")
    assert Task.objects.using("second").filter(pk=int(result.id), queue="mail").exists()
    assert misrouted(["mail"], "second") == {}  # so a worker may serve it there: run_worker --database second

    added = admin_client.post(ADD + "?db=second", {"name": "mail", "paused": "on"})
    assert added.status_code == 302, added.content[:1000]
    assert QueueControl.objects.using("second").get(name="mail").paused
    assert Task.objects.db_manager("second").claim("w1", queues=["mail"]) == []

    admin_client.post(LIST + "?db=second", {"action": "resume", "_selected_action": ["mail"]})
    assert not QueueControl.objects.using("second").get(name="mail").paused
    admin_client.post(LIST + "?db=second", {"action": "pause", "_selected_action": ["mail"]})
    assert QueueControl.objects.using("second").get(name="mail").paused
    assert Task.objects.db_manager("second").claim("w1", queues=["mail"]) == []
    assert not QueueControl.objects.using("default").exists()  # nothing written where it would pause nobody

    # A queue whose tasks never land in the database shown is still refused there.
    refused = admin_client.post(ADD + "?db=second", {"name": "default", "paused": "on"})
    assert refused.status_code == 200 and b"lives in database" in refused.content
    assert not QueueControl.objects.using("second").filter(name="default").exists()


def test_the_dashboard_pauses_a_pinned_queue_where_its_workers_claim(admin_client: Client, pinned: None) -> None:
    Task.objects.db_manager("second").enqueue(NOOP, queue="mail")
    response = admin_client.post("/dashboard/queues/?db=second", {"name": "mail", "action": "pause"})
    assert response.status_code == 302
    assert QueueControl.objects.using("second").get(name="mail").paused
    assert not QueueControl.objects.using("default").exists()
    assert Task.objects.db_manager("second").claim("w1", queues=["mail"]) == []
    page = admin_client.get("/dashboard/queues/?db=second")
    assert [q["paused"] for q in page.context["queues"] if q["name"] == "mail"] == [True]


def test_the_api_pauses_a_pinned_queue_where_its_workers_claim(admin_client: Client, pinned: None) -> None:
    """``?db=second`` names a database the queue's tasks land in: the pause goes there. Without it,
    the queue's route (default); a database the queue's tasks never land in is a 400 that writes
    nothing."""
    Task.objects.db_manager("second").enqueue(NOOP, queue="mail")
    paused = admin_client.post("/api/queues/mail/pause?db=second", "{}", content_type="application/json")
    assert paused.status_code == 200, paused.content
    check_answer(paused)
    assert paused.json()["queue"]["paused"]
    assert QueueControl.objects.using("second").get(name="mail").paused
    assert Task.objects.db_manager("second").claim("w1", queues=["mail"]) == []
    refused = admin_client.post("/api/queues/reports/pause?db=default", "{}", content_type="application/json")
    assert refused.status_code == 400 and refused.json()["field"] == "db"
    check_answer(refused)
    assert not QueueControl.objects.filter(name="reports").exists()
    assert not QueueControl.objects.using("second").filter(name="reports").exists()
    resumed = admin_client.post("/api/queues/mail/resume?db=second", "{}", content_type="application/json")
    assert resumed.status_code == 200 and not QueueControl.objects.using("second").get(name="mail").paused
    check_answer(resumed)
    assert not QueueControl.objects.using("default").exists()


@pytest.mark.parametrize("query", ["db=nowhere", "db=second&db=default", "db=%00", "db=" + "x" * 5000])
def test_a_pause_action_on_a_hostile_db_changes_nothing(admin_client: Client, query: str) -> None:
    QueueControl.objects.db_manager("second").resume("reports")
    response = admin_client.post(f"{LIST}?{query}", {"action": "pause", "_selected_action": ["reports"]})
    assert response.status_code in (302, 400), response.status_code
    assert not QueueControl.objects.using("second").get(name="reports").paused
    assert not QueueControl.objects.using("default").exists()


def test_two_pauses_that_read_the_switches_first_end_with_one_pause_and_one_message() -> None:
    """Two admin requests (each a transaction that has read the switches, as the form's validation
    and the action's selection do) pause at the same moment: each holds the table's ACCESS SHARE and
    wants ACCESS EXCLUSIVE, a deadlock. PostgreSQL aborts one of them; that one must be the "try
    again" error (a message in the admin), not an OperationalError (a 500), and the other pause lands."""
    import threading

    from django.db import connection, transaction

    from tasks.exceptions import TaskError

    both_read = threading.Barrier(2, timeout=10)
    outcomes: dict[str, str] = {}

    def request(name: str) -> None:
        try:
            with transaction.atomic():
                list(QueueControl.objects.all())  # the request's read of the switches
                both_read.wait()
                QueueControl.objects.pause(name, by="admin")
            outcomes[name] = "paused"
        except TaskError as exc:
            outcomes[name] = f"message: {exc}"
        except Exception as exc:  # what would be a 500
            outcomes[name] = f"500: {type(exc).__name__}: {exc}"
        finally:
            connection.close()

    threads = [threading.Thread(target=request, args=(name,)) for name in ("mail", "sms")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(v.split(":")[0] for v in outcomes.values()) == ["message", "paused"], outcomes
    paused = [name for name, v in outcomes.items() if v == "paused"]
    assert list(QueueControl.objects.filter(paused=True).values_list("name", flat=True)) == paused


def test_the_command_pauses_a_pinned_queue_where_its_workers_claim(pinned: None) -> None:
    from io import StringIO

    from django.core.management import CommandError, call_command

    Task.objects.db_manager("second").enqueue(NOOP, queue="mail")
    out = StringIO()
    call_command("tasks_queue", "pause", "mail", database="second", stdout=out)
    assert out.getvalue().startswith("mail: paused, 1 waiting, 0 running") and "[database second]" in out.getvalue()
    assert QueueControl.objects.using("second").get(name="mail").paused
    assert not QueueControl.objects.using("default").exists()
    assert Task.objects.db_manager("second").claim("w1", queues=["mail"]) == []
    with pytest.raises(CommandError, match="would pause nobody"):
        call_command("tasks_queue", "pause", "reports", database="default")  # routed to second only
    assert QueueControl.objects.using("second").filter(name="reports").count() == 0
