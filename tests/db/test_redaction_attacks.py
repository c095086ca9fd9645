"""Attacks on LEASING_TASKS["REDACT_ARGUMENTS"] (issue 41) beyond test_argument_redaction.py: the
surfaces it did not visit (a schedule's arguments in the JSON API, a stored schedule, the admin's
history and delete pages), a redactor that returns the wrong shape, and a redactor that hides by task
path, whose secrets an argument search must not confirm."""

from __future__ import annotations

import datetime as dt
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from tasks.models import Failure, StoredSchedule, Task
from tasks.workflows import Step, chain
from tests.helpers.api import Api

pytestmark = pytest.mark.django_db

PATH = "tests.testapp.handlers.noop"
SECRET = "hunter2-secret"
KWARGS = {"user": "ada", "Password": SECRET, "nested": [{"api_key": SECRET}]}


@pytest.fixture
def redacting_api(settings: Any) -> Api:
    settings.LEASING_TASKS = {
        **settings.LEASING_TASKS,
        "REDACT_ARGUMENTS": ["password", "api_key"],
        "API_TASK_PATTERNS": ["tests.testapp.handlers.*"],
        "SCHEDULES": {"nightly": {"task": PATH, "interval": 3600, "kwargs": KWARGS, "args": [{"PASSWORD": SECRET}]}},
    }
    settings.LEASING_API_TOKENS = ["redaction-token"]
    return Api(Client(), headers={"Authorization": "Bearer redaction-token"})


def test_a_declared_schedule_keeps_its_secrets_out_of_the_schedules_api(redacting_api: Api) -> None:
    """The schedule's page redacts its arguments (test_argument_redaction); its JSON must too: a
    read-only API client would otherwise read the password a schedule passes to its task."""
    for url in ("/api/schedules", "/api/schedules/nightly"):
        status, body = redacting_api.call("GET", url)
        assert status == 200, (url, body)
        assert SECRET not in str(body), f"{url} shows the schedule's secret argument"
    status, body = redacting_api.call("GET", "/api/schedules/nightly")
    definition = body["schedule"]["definition"] if "schedule" in body else body["definition"]
    assert definition["kwargs"]["user"] == "ada" and definition["kwargs"]["Password"] == "[redacted]"


def test_a_stored_schedule_keeps_its_secrets_out_of_the_api_and_pages(redacting_api: Api, staff: Client) -> None:
    entry = {"name": "stored-one", "task": PATH, "interval": 600, "kwargs": KWARGS}
    status, body = redacting_api.call("POST", "/api/schedules", entry)
    assert status == 201, body
    leaks = [] if SECRET not in str(body) else ["POST /api/schedules"]
    for url in ("/api/schedules", "/api/schedules/stored-one"):
        status, body = redacting_api.call("GET", url)
        assert status == 200, (url, body)
        if SECRET in str(body):
            leaks.append(f"GET {url}")
    for url in ("/dashboard/schedules/", "/dashboard/schedules/stored-one/", "/admin/tasks/storedschedule/"):
        response = staff.get(url)
        assert response.status_code == 200, url
        if SECRET in response.content.decode():
            leaks.append(url)
    assert leaks == []
    status, body = redacting_api.call("GET", "/api/schedules/stored-one")
    assert body["schedule"]["definition"]["kwargs"]["Password"] == "[redacted]"
    # The entry read back, written back: the placeholder would replace the secret. Refused, unchanged.
    status, body = redacting_api.call(
        "PUT", "/api/schedules/stored-one", {**entry, "kwargs": {**KWARGS, "Password": "[redacted]"}}
    )
    assert status == 400 and body["field"] == "kwargs" and "REDACT_ARGUMENTS" in body["error"], body
    assert StoredSchedule.objects.get(name="stored-one").entry["kwargs"] == KWARGS
    # A patch that leaves the arguments out keeps the stored ones.
    status, body = redacting_api.call("PATCH", "/api/schedules/stored-one", {"interval": 900})
    assert status == 200, body
    assert StoredSchedule.objects.get(name="stored-one").entry["kwargs"] == KWARGS


def test_the_admin_history_and_delete_pages_show_no_secret_and_no_raw_status(redacting_api: Api, staff: Client) -> None:
    """The admin names a task by str(task) on its history, delete and change pages (the breadcrumb):
    no argument there, and the status by its label, as every page says it (one vocabulary)."""
    task = Task.objects.enqueue(PATH, queue="secrets", kwargs=KWARGS)
    pages = [f"/admin/tasks/task/{task.id}/change/", f"/admin/tasks/task/{task.id}/history/"]
    for url in pages:
        response = staff.get(url)  # the history page was a 500: the task list's paginator took its log
        assert response.status_code == 200, url
        body = response.content.decode()
        assert SECRET not in body, url
        assert "[READY]" not in body and "[Ready]" in body, f"{url} names the task by its raw status"
    assert Task.objects.filter(pk=task.id).cancel() == 1  # only a finished task may be deleted
    for url in [*pages, f"/admin/tasks/task/{task.id}/delete/"]:
        response = staff.get(url)
        assert response.status_code == 200, url
        body = response.content.decode()
        assert SECRET not in body, url
        assert "[CANCELLED]" not in body and "[Cancelled]" in body, f"{url} names the task by its raw status"


def three_values(task_path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A redactor with a bug: three values, not (args, kwargs)."""
    return args, kwargs, None


def not_json(task_path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A redactor with a bug: what it returns is no JSON (a set, an object)."""
    return {"x"}, {"user": object()}


@pytest.mark.parametrize("redactor", ["three_values", "not_json"])
def test_a_redactor_returning_the_wrong_shape_hides_everything_and_breaks_no_page(
    redacting_api: Api, staff: Client, settings: Any, redactor: str
) -> None:
    task = Task.objects.enqueue(PATH, queue="secrets", args=[SECRET], kwargs=KWARGS)
    settings.LEASING_TASKS = {
        **settings.LEASING_TASKS,
        "REDACT_ARGUMENTS": f"tests.db.test_redaction_attacks.{redactor}",
    }
    staff.raise_request_exception = False
    redacting_api.client.raise_request_exception = False
    page = staff.get(f"/dashboard/tasks/{task.id}/")
    assert page.status_code == 200 and SECRET not in page.content.decode()
    status, body = redacting_api.call("GET", f"/api/tasks/{task.id}")
    assert status == 200 and SECRET not in str(body)


def hide_card_of_charge(task_path: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """A project's redactor: the card number of its charge task only (the form the docs offer: a
    callable given the task path)."""
    if task_path == PATH:
        kwargs = {k: "[redacted]" if k == "card" else v for k, v in kwargs.items()}
    return args, kwargs


@pytest.mark.django_db(transaction=True)  # the index is built CONCURRENTLY: outside a transaction
def test_a_search_cannot_confirm_a_secret_a_callable_hides_by_task_path(staff: Client, settings: Any) -> None:
    settings.LEASING_TASKS = {
        **settings.LEASING_TASKS,
        "REDACT_ARGUMENTS": "tests.db.test_redaction_attacks.hide_card_of_charge",
    }
    task = Task.objects.enqueue(PATH, queue="secrets", kwargs={"card": "4242-4242", "amount": 5})
    Task.objects.filter(pk=task.id).update(run_after=timezone.now() - dt.timedelta(hours=1))
    claimed = Task.objects.claim("w1", limit=1, queues=["secrets"], ttl=30)[0]
    assert Task.objects.fail(Failure(claimed.id, claimed.token, "builtins.TypeError", "boom", retry=False), "w1")
    page = staff.get(f"/dashboard/tasks/{task.id}/").content.decode()
    assert "4242-4242" not in page  # the redactor is applied to the page
    call_command("tasks_search_index", "create", stdout=StringIO())
    try:
        right = staff.get("/dashboard/tasks/failed/", {"q": 'kwargs:{"card": "4242-4242"}'})
        wrong = staff.get("/dashboard/tasks/failed/", {"q": 'kwargs:{"card": "1111-1111"}'})
        found = [t.pk for t in right.context["tasks"]] if right.context else []
        missed = [t.pk for t in wrong.context["tasks"]] if wrong.context else []
        # Whatever the answer (refused, or nothing), the right guess must not look unlike the wrong one.
        assert (found == [task.id]) == (missed == [task.id]), "the search confirms the hidden card number"
    finally:
        call_command("tasks_search_index", "drop", stdout=StringIO())


def test_a_debounced_task_and_a_workflow_members_secrets_stay_hidden(redacting_api: Api, staff: Client) -> None:
    """A debounced task's arguments are replaced by each enqueue of its key (the newest win) and a
    workflow member's come from its step: hidden on the task's page, the workflow's page, the every
    task list and the API alike."""
    first = Task.objects.enqueue(PATH, queue="secrets", kwargs={"password": "old-secret"}, dedup_key="d", debounce=60)
    again = Task.objects.enqueue(PATH, queue="secrets", kwargs={"password": SECRET, "n": 2}, dedup_key="d", debounce=60)
    assert again.id == first.id and Task.objects.get(pk=first.id).kwargs["password"] == SECRET
    workflow = chain(
        Step(PATH, kwargs=KWARGS, queue="secrets"), Step(PATH, kwargs={"API_KEY": SECRET}, queue="secrets")
    ).enqueue()
    members = list(Task.objects.filter(workflow_id=workflow.id).values_list("pk", flat=True))
    urls = [
        f"/dashboard/tasks/{first.id}/",
        *(f"/dashboard/tasks/{pk}/" for pk in members),
        f"/dashboard/workflows/{workflow.id}/",
        f"/dashboard/tasks/?workflow={workflow.id}",
        "/dashboard/tasks/?dedup_key=d",
        f"/admin/tasks/task/?workflow_id={workflow.id}",
    ]
    for url in urls:
        response = staff.get(url)
        assert response.status_code == 200, url
        assert SECRET not in response.content.decode() and "old-secret" not in response.content.decode(), url
    for url in (f"/api/tasks/{first.id}", *(f"/api/tasks/{pk}" for pk in members), f"/api/workflows/{workflow.id}"):
        status, body = redacting_api.call("GET", url)
        assert status == 200 and SECRET not in str(body), url
