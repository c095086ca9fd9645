"""LEASING_TASKS["REDACT_ARGUMENTS"]: a secret argument never appears on a page, in the admin or in
an API response, whatever page, filter or search shows its task; the row keeps it and the worker
gets it; a search (or a bulk filter) naming a hidden key is refused, one on a shown key works."""

from __future__ import annotations

import datetime as dt
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from tasks.checks import check_task_settings
from tasks.models import Failure, Task
from tests.helpers.api import Api

pytestmark = pytest.mark.django_db

PATH = "tests.testapp.handlers.noop"
SECRETS = ("hunter2-secret", "sk-live-0123", "positional-secret")
KWARGS = {
    "to": "ada@example.com",
    "PassWord": "hunter2-secret",
    "nested": {"deep": [{"api_key": "sk-live-0123", "region": "eu"}]},
}
ARGS = [7, {"password": "positional-secret"}]


@pytest.fixture
def redacting(settings: Any) -> None:
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "REDACT_ARGUMENTS": ["password", "API_KEY"]}
    settings.LEASING_API_TOKENS = ["redaction-token"]


def hide_everything(task_path: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """A redactor given by its dotted path: every value hidden, keys kept."""
    return ["[redacted]"] * len(args), dict.fromkeys(kwargs, "[redacted]")


def broken_redactor(task_path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    raise RuntimeError("a bug in the project's redactor")


def tasks_in_every_state() -> dict[str, int]:
    """A task with the secrets in each of a few states: failed, retrying, waiting, successful."""
    ids: dict[str, int] = {}
    for name in ("failed", "retrying", "succeeded", "pending"):
        ids[name] = Task.objects.enqueue(PATH, queue="secrets", args=ARGS, kwargs=KWARGS, max_attempts=2).id
    for name in ("failed", "retrying", "succeeded"):
        Task.objects.filter(pk=ids[name]).update(run_after=timezone.now() - dt.timedelta(hours=1), priority=9)
        claimed = Task.objects.claim("w1", limit=1, queues=["secrets"], ttl=30)[0]
        assert claimed.id == ids[name]
        if name == "succeeded":
            assert Task.objects.complete(claimed.id, "w1", claimed.token, {"sent": 7})
        else:
            failure = Failure(claimed.id, claimed.token, "builtins.TypeError", "boom", retry=name == "retrying")
            assert Task.objects.fail(failure, "w1")
        Task.objects.filter(pk=claimed.id).update(priority=0, run_after=timezone.now() + dt.timedelta(hours=1))
    return ids


def assert_no_secret(body: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in body, f"{secret!r} shown by {where}"


def search_index(action: str) -> None:
    call_command("tasks_search_index", action, stdout=StringIO())


def test_no_page_api_response_or_admin_page_shows_a_secret(staff: Client, redacting: None) -> None:
    ids = tasks_in_every_state()
    api = Api(Client(), headers={"Authorization": "Bearer redaction-token"})
    pages = [
        "/dashboard/",
        "/dashboard/tasks/",
        "/dashboard/tasks/?status=Failed",
        "/dashboard/tasks/?queue=secrets",
        f"/dashboard/tasks/?task_path={PATH}",
        *[f"/dashboard/tasks/{state}/" for state in ("failed", "retrying", "succeeded", "pending")],
        f"/dashboard/tasks/failed/?q={ids['failed']}",
        f"/dashboard/tasks/failed/?q={PATH}",
        "/admin/tasks/task/",
        "/admin/tasks/task/?status__exact=FAILED",
        f"/admin/tasks/task/?q={ids['failed']}",
        f"/admin/tasks/task/?q={PATH}",
        *[f"/dashboard/tasks/{task_id}/" for task_id in ids.values()],
        *[f"/admin/tasks/task/{task_id}/change/" for task_id in ids.values()],
    ]
    for url in pages:
        response = staff.get(url)
        assert response.status_code == 200, url
        assert_no_secret(response.content.decode(), url)
    detail = staff.get(f"/dashboard/tasks/{ids['failed']}/").content.decode()
    assert "&quot;PassWord&quot;: &quot;[redacted]&quot;" in detail
    assert "&quot;region&quot;: &quot;eu&quot;" in detail and "ada@example.com" in detail  # the rest is shown
    admin = staff.get(f"/admin/tasks/task/{ids['failed']}/change/").content.decode()
    assert "[redacted]" in admin and "ada@example.com" in admin
    # JSON, not Python reprs, in the admin too.
    succeeded = staff.get(f"/admin/tasks/task/{ids['succeeded']}/change/").content.decode()
    assert "{&quot;sent&quot;: 7}" in succeeded and "&#x27;sent&#x27;" not in succeeded

    for url in ("/api/tasks", "/api/tasks/processed", *[f"/api/tasks/{task_id}" for task_id in ids.values()]):
        status, body = api.call("GET", url)
        assert status == 200, url
        assert_no_secret(str(body), url)
    status, body = api.call("GET", f"/api/tasks/{ids['pending']}")
    assert body["task"]["kwargs"]["PassWord"] == "[redacted]"
    assert body["task"]["kwargs"]["nested"] == {"deep": [{"api_key": "[redacted]", "region": "eu"}]}
    assert body["task"]["args"] == [7, {"password": "[redacted]"}]
    status, body = api.enqueue({"task_path": "tasks.demo.sleep", "kwargs": {"password": "x-secret-x"}})
    assert status == 201 and "x-secret-x" not in str(body)

    # The rows keep the values; a client claiming a task to run it gets them.
    assert Task.objects.get(pk=ids["pending"]).kwargs == KWARGS
    Task.objects.filter(pk=ids["pending"]).update(run_after=timezone.now() - dt.timedelta(hours=1))
    status, body = api.call("POST", "/api/tasks/next", {"worker": "http-1", "queues": ["secrets"]})
    assert status == 200 and body["task"]["id"] == ids["pending"]
    assert body["task"]["kwargs"] == KWARGS and body["task"]["args"] == ARGS


@pytest.mark.django_db(transaction=True)  # the index is built CONCURRENTLY: outside a transaction
def test_searching_a_hidden_key_is_refused_and_a_shown_key_still_finds(staff: Client, redacting: None) -> None:
    ids = tasks_in_every_state()
    search_index("create")
    try:
        shown = staff.get("/dashboard/tasks/failed/", {"q": 'kwargs:{"to": "ada@example.com"}'})
        assert [task.pk for task in shown.context["tasks"]] == [ids["failed"]]
        nested = staff.get("/dashboard/tasks/failed/", {"q": 'kwargs:{"nested": {"deep": [{"region": "eu"}]}}'})
        assert [task.pk for task in nested.context["tasks"]] == [ids["failed"]]
        # A guess of a hidden value would be confirmed by its result: refused, whatever the case of the key.
        for term in ('kwargs:{"password": "hunter2-secret"}', 'kwargs:{"nested": {"deep": [{"API_KEY": "x"}]}}'):
            page = staff.get("/dashboard/tasks/failed/", {"q": term})
            body = page.content.decode()
            assert "Search refused" in body and "REDACT_ARGUMENTS" in body
            assert list(page.context["tasks"]) == []
            admin = staff.get("/admin/tasks/task/", {"q": term}).content.decode()
            assert "Search refused" in admin and f'data-task="{ids["failed"]}"' not in admin
            every = staff.get("/dashboard/tasks/", {"q": term})
            assert every.status_code == 400 and "REDACT_ARGUMENTS" in every.content.decode()
    finally:
        search_index("drop")
    # A bulk operation's matched count would tell too: refused, and nothing is requested.
    api = Api(Client(), headers={"Authorization": "Bearer redaction-token"})
    status, body = api.call(
        "POST",
        "/api/tasks/bulk",
        {"kind": "retry", "filter": {"status": "FAILED", "kwargs_contains": {"PASSWORD": "hunter2-secret"}}},
    )
    assert status == 400 and "REDACT_ARGUMENTS" in body["error"]


def test_a_schedule_page_shows_its_arguments_redacted(staff: Client, settings: Any) -> None:
    settings.LEASING_TASKS = {
        "REDACT_ARGUMENTS": ["password"],
        "SCHEDULES": {
            "nightly": {"task": PATH, "interval": 60, "kwargs": {"user": "ada", "password": "hunter2-secret"}}
        },
    }
    page = staff.get("/dashboard/schedules/nightly/").content.decode()
    assert_no_secret(page, "the schedule page")
    assert "&quot;password&quot;: &quot;[redacted]&quot;" in page and "&quot;user&quot;: &quot;ada&quot;" in page


def test_a_redactor_callable_is_applied_and_one_that_fails_hides_everything(staff: Client, settings: Any) -> None:
    task_id = Task.objects.enqueue(PATH, queue="secrets", args=ARGS, kwargs=KWARGS).id
    settings.LEASING_TASKS = {
        **settings.LEASING_TASKS,
        "REDACT_ARGUMENTS": "tests.db.test_argument_redaction.hide_everything",
    }
    page = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    assert_no_secret(page, "the task page")
    assert "ada@example.com" not in page and "&quot;to&quot;: &quot;[redacted]&quot;" in page
    settings.LEASING_TASKS = {
        **settings.LEASING_TASKS,
        "REDACT_ARGUMENTS": "tests.db.test_argument_redaction.broken_redactor",
    }
    page = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    assert_no_secret(page, "the task page")
    assert "ada@example.com" not in page


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("tests.db.nowhere.redact", "cannot be imported"),
        ("tests.db.test_argument_redaction.PATH", "not callable"),
        (["password", ""], "non-empty string"),
        ({"password": True}, "list of key names"),
    ],
)
def test_a_bad_setting_fails_the_system_check(settings: Any, value: Any, says: str) -> None:
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "REDACT_ARGUMENTS": value}
    errors = [e for e in check_task_settings() if e.id == "tasks.E121"]
    assert len(errors) == 1 and says in errors[0].msg


def test_good_settings_pass_the_check(settings: Any) -> None:
    for value in (["password"], ("token",), "tests.db.test_argument_redaction.hide_everything", []):
        settings.LEASING_TASKS = {**settings.LEASING_TASKS, "REDACT_ARGUMENTS": value}
        assert [e for e in check_task_settings() if e.id == "tasks.E121"] == []
