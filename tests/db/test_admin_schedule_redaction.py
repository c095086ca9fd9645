"""REDACT_ARGUMENTS in the admin's schedule pages (issue 56): every admin page of a schedule, a stored
schedule, their runs and their tasks keeps a hidden argument hidden, top-level or nested; the stored
schedule's change form shows it as "[redacted]" and a save never stores that placeholder over the
secret (unchanged, it keeps the stored value; a placeholder where nothing was hidden is refused)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.test import Client

from leasing.models import Lease
from tasks.maintenance.scheduler import SCHEDULER_LEASE, Scheduler, ScheduleState, SlotWriter, database_now
from tasks.models import Schedule, ScheduleRun, StoredSchedule, Task
from tests.factories import StaffFactory
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db

SECRET = "hunter2-admin-secret"
NESTED = "nested-admin-secret"
ARGS = [{"password": SECRET}, 3]
KWARGS = {"user": "ada", "password": SECRET, "auth": {"Password": NESTED, "realm": "x"}}


@pytest.fixture
def superuser(settings: Any) -> Client:
    settings.LEASING_TASKS = {
        **settings.LEASING_TASKS,
        "REDACT_ARGUMENTS": ["password"],
        "API_TASKS": [NOOP],
    }
    client = Client()
    client.force_login(StaffFactory.create(is_superuser=True))
    return client


@pytest.fixture
def stored(superuser: Client) -> StoredSchedule:
    """A stored schedule with secrets, its progress row (synced by a leader) and one run with its task."""
    row = StoredSchedule.objects.create_stored(
        "with-secret", {"task": NOOP, "interval": 60, "args": ARGS, "kwargs": KWARGS}
    )
    assert row is not None
    StoredSchedule.objects.filter(name=row.name).update(effective_from=database_now() - dt.timedelta(seconds=90))
    grant = Lease.objects.acquire(SCHEDULER_LEASE, "sched-a", 30)
    assert grant is not None
    scheduler = Scheduler(schedules={}, ttl=30)
    writer = SlotWriter(holder="sched-a", token=grant.token)
    states: dict[str, ScheduleState] = {}
    scheduler.refresh(writer, states)
    assert scheduler.round(writer, states).enqueued, "a slot of the stored schedule enqueued"
    assert SECRET in str(Schedule.objects.get(name=row.name).definition)  # the row keeps the values
    return StoredSchedule.objects.get(name=row.name)


def admin_pages(name: str) -> list[str]:
    run = ScheduleRun.objects.get(schedule=name)
    task = Task.objects.get(pk=run.task_id)
    assert task.kwargs == KWARGS
    return [
        "/admin/tasks/schedule/",
        f"/admin/tasks/schedule/{name}/change/",
        f"/admin/tasks/schedule/{name}/history/",
        f"/admin/tasks/schedule/{name}/delete/",
        "/admin/tasks/schedulerun/",
        f"/admin/tasks/schedulerun/{run.pk}/change/",
        "/admin/tasks/storedschedule/",
        "/admin/tasks/storedschedule/add/",
        f"/admin/tasks/storedschedule/{name}/change/",
        f"/admin/tasks/storedschedule/{name}/history/",
        f"/admin/tasks/storedschedule/{name}/delete/",
        "/admin/tasks/task/",
        f"/admin/tasks/task/{task.pk}/change/",
        f"/admin/tasks/task/{task.pk}/history/",
    ]


def test_no_admin_page_of_a_schedule_or_its_tasks_shows_a_redacted_argument(
    superuser: Client, stored: StoredSchedule
) -> None:
    leaks = []
    for url in admin_pages(stored.name):
        response = superuser.get(url)
        assert response.status_code == 200, url
        body = response.content.decode()
        leaks += [(url, secret) for secret in (SECRET, NESTED) if secret in body]
    assert leaks == []
    # What is not hidden is still shown, and the hidden values as the placeholder.
    body = superuser.get(f"/admin/tasks/schedule/{stored.name}/change/").content.decode()
    assert "ada" in body and "realm" in body and "[redacted]" in body
    body = superuser.get(f"/admin/tasks/storedschedule/{stored.name}/change/").content.decode()
    assert "ada" in body and "realm" in body and "[redacted]" in body


def submitted(client: Client, name: str, **changes: Any) -> dict[str, Any]:
    """The change form's fields as the browser submits them (what the page rendered), with ``changes``."""
    form = client.get(f"/admin/tasks/storedschedule/{name}/change/").context["adminform"].form
    data: dict[str, Any] = {}
    for field in form.fields:
        value = form[field].value()
        if field == "paused":
            if value:
                data[field] = "on"
            continue
        data[field] = "" if value is None else value
    data.update(changes)
    data["_save"] = "Save"
    return data


def save(client: Client, name: str, data: dict[str, Any]) -> Any:
    return client.post(f"/admin/tasks/storedschedule/{name}/change/", data)


def test_saving_the_change_form_unchanged_keeps_the_stored_secret(superuser: Client, stored: StoredSchedule) -> None:
    data = submitted(superuser, stored.name)
    assert SECRET not in str(data) and NESTED not in str(data)
    response = save(superuser, stored.name, data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    row = StoredSchedule.objects.get(name=stored.name)
    assert row.entry["args"] == ARGS and row.entry["kwargs"] == KWARGS
    assert row.revision > stored.revision  # saved (the admin writes every save), not refused


def test_editing_another_field_keeps_the_stored_secret(superuser: Client, stored: StoredSchedule) -> None:
    data = submitted(superuser, stored.name, interval="900")
    # A visible key edited beside the hidden ones, in the same JSON field.
    data["kwargs"] = data["kwargs"].replace('"ada"', '"bob"')
    response = save(superuser, stored.name, data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    row = StoredSchedule.objects.get(name=stored.name)
    assert row.entry["interval"] == 900
    assert row.entry["args"] == ARGS
    assert row.entry["kwargs"] == {**KWARGS, "user": "bob"}
    # A new secret typed in place of the placeholder is stored as typed.
    data = submitted(superuser, stored.name)
    shown = json.loads(data["kwargs"])
    assert shown["password"] == "[redacted]"
    data["kwargs"] = json.dumps({**shown, "password": "typed-new"})
    assert save(superuser, stored.name, data).status_code == 302
    assert StoredSchedule.objects.get(name=stored.name).entry["kwargs"] == {
        **KWARGS,
        "user": "bob",
        "password": "typed-new",
    }


def test_a_placeholder_where_nothing_was_hidden_is_refused_and_changes_nothing(
    superuser: Client, stored: StoredSchedule
) -> None:
    data = submitted(superuser, stored.name)
    data["kwargs"] = data["kwargs"].replace('"ada"', '"[redacted]"')  # "user" was never hidden
    response = save(superuser, stored.name, data)
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert "kwargs" in errors and "[redacted]" in str(errors["kwargs"]), errors
    row = StoredSchedule.objects.get(name=stored.name)
    assert row.entry["kwargs"] == KWARGS and row.revision == stored.revision
    # A new schedule has no stored value to keep: the placeholder is refused there too.
    response = superuser.post(
        "/admin/tasks/storedschedule/add/",
        {"name": "new-one", "task": NOOP, "interval": "60", "kwargs": '{"password": "[redacted]"}', "_save": "Save"},
    )
    assert response.status_code == 200 and "kwargs" in response.context["adminform"].form.errors
    assert not StoredSchedule.objects.filter(name="new-one").exists()


def hide_every_argument(task_path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A redactor that fails (returns no pair): every argument is hidden, by position and by key."""
    return None


def test_with_a_redactor_callable_a_save_unchanged_keeps_every_hidden_argument(
    superuser: Client, stored: StoredSchedule, settings: Any
) -> None:
    settings.LEASING_TASKS = {
        **settings.LEASING_TASKS,
        "REDACT_ARGUMENTS": f"{__name__}.hide_every_argument",
    }
    data = submitted(superuser, stored.name, interval="120")
    assert json.loads(data["args"]) == ["[redacted]", "[redacted]"]
    assert SECRET not in str(data) and "ada" not in str(data)
    assert save(superuser, stored.name, data).status_code == 302
    row = StoredSchedule.objects.get(name=stored.name)
    assert (row.entry["interval"], row.entry["args"], row.entry["kwargs"]) == (120, ARGS, KWARGS)
