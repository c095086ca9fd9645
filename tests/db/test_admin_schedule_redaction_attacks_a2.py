"""Attacks on the stored schedule's change form under REDACT_ARGUMENTS: a placeholder kept where the
page showed one must keep its secret hidden on the saved schedule too. With a redactor that hides by
task path, a save that changed the task and kept the placeholder stored the secret under a task
whose arguments are shown: the next page showed it in clear."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from tasks.models import StoredSchedule
from tests.db.test_admin_schedule_redaction import ARGS, KWARGS, SECRET, save, submitted, superuser
from tests.db.test_admin_schedule_redaction import stored as stored_fixture
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db

__all__ = ["stored", "superuser"]

ECHO = "tests.testapp.handlers.echo"
stored = stored_fixture


def hide_for_noop_only(task_path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Hides every argument of NOOP's tasks, none of another task's."""
    if task_path == NOOP:
        return ["[redacted]" for _ in args], dict.fromkeys(kwargs, "[redacted]")
    return args, kwargs


@pytest.fixture
def by_task_path(settings: Any, stored: StoredSchedule) -> StoredSchedule:
    settings.LEASING_TASKS = {
        **settings.LEASING_TASKS,
        "REDACT_ARGUMENTS": f"{__name__}.hide_for_noop_only",
        "API_TASKS": [NOOP, ECHO],
    }
    return stored


def test_a_kept_placeholder_under_a_task_that_shows_its_arguments_is_refused(
    superuser: Client, by_task_path: StoredSchedule
) -> None:
    name = by_task_path.name
    data = submitted(superuser, name, task=ECHO)
    assert SECRET not in str(data)
    response = save(superuser, name, data)
    row = StoredSchedule.objects.get(name=name)
    page = superuser.get(f"/admin/tasks/storedschedule/{name}/change/").content.decode()
    assert SECRET not in page, "the secret kept from the placeholder is shown under the new task"
    assert response.status_code == 200 and "[redacted]" in str(response.context["adminform"].form.errors)
    assert (row.entry["task"], row.entry["args"], row.entry["kwargs"]) == (NOOP, ARGS, KWARGS)
    # The real values typed in place of the placeholders under the new task are stored as typed.
    data["args"], data["kwargs"] = json.dumps([1]), json.dumps({"user": "ada"})
    assert save(superuser, name, data).status_code == 302
    assert StoredSchedule.objects.get(name=name).entry["task"] == ECHO


def test_an_api_patch_of_the_task_alone_does_not_show_the_kept_secret(
    by_task_path: StoredSchedule, settings: Any
) -> None:
    """The JSON API's PATCH keeps the stored arguments it hid: a patch of the task alone, to a task
    whose arguments are shown, is refused (the answer and every later read would show them)."""
    from django.test import Client as Plain

    from tests.helpers.api import TOKEN, Api

    settings.LEASING_API_TOKENS = [TOKEN]
    api = Api(Plain())
    name = by_task_path.name
    status, body = api.call("GET", f"/api/schedules/{name}")
    assert status == 200 and SECRET not in json.dumps(body), body
    status, body = api.call("PATCH", f"/api/schedules/{name}", {"task": ECHO})
    assert SECRET not in json.dumps(body)
    assert status == 400, body
    row = StoredSchedule.objects.get(name=name)
    assert (row.entry["task"], row.revision) == (NOOP, by_task_path.revision)
    # With the arguments given, the task changes.
    status, body = api.call("PATCH", f"/api/schedules/{name}", {"task": ECHO, "args": [1], "kwargs": {}})
    assert status == 200, body
    status, body = api.call("GET", f"/api/schedules/{name}")
    assert SECRET not in json.dumps(body)
