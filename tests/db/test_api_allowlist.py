"""The task-path allow-list of the JSON API: exact names or full-match patterns, and only public
module-level functions defined in the named module; a worker checks again before it imports."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import pytest
from django.db import connections
from django.test import Client

from tasks.backends import allowlist
from tasks.exceptions import TaskPathRefused
from tasks.models import Task
from tasks.worker.process import Worker
from tests.helpers import wait_until
from tests.helpers.api import TOKEN, check_answer
from tests.testapp.models import Effect

pytestmark = pytest.mark.usefixtures("api_token")

HEADERS = {"Authorization": f"Bearer {TOKEN}"}
LOOSE = {"API_TASK_PATTERNS": [r"tasks\.demo\..*", r"tests\.testapp\.api_targets\..*"]}


def enqueue(client: Client, path: str) -> tuple[int, Any]:
    response = client.post(
        "/api/tasks", json.dumps({"task_path": path}), content_type="application/json", headers=HEADERS
    )
    check_answer(response)
    return response.status_code, response.json()


REFUSED = [
    "tasks.demo._freeze_process",  # private
    "tasks.demo.os.system",  # an attribute of an imported module
    "tasks.demo.os",  # a module
    "tasks.demo.random",
    "tasks.demo.signal",
    "tasks.demo.__class__",  # dunder
    "tasks.demo.sleep\n",  # a trailing newline passes a `$`, not fullmatch
    "tasks.demo.current_task",  # a function imported from tasks.runtime
    "tasks.demo.get_settings",
    "tasks.demo.logger",  # an object
    "tasks.demo.STEP",  # a constant
    "tasks.demo.Any",
    "tests.testapp.api_targets.getcwd",  # imported with from-import
    "tests.testapp.api_targets.json",
    "tests.testapp.api_targets._private",
    "tests.testapp.api_targets.Job",  # a class
    "tests.testapp.api_targets.Job.method",  # not module level
    "tests.testapp.api_targets.alias",  # defined as `public`, exposed under another name
    "tests.testapp.api_targets.instance",
    "tests.testapp.api_targets.lambda_handler",
    "tests.testapp.api_targets.CONSTANT",
    "tests.testapp.api_targets.missing",
    "tests.testapp.api_targets.task",  # the django.tasks decorator, imported
]


@pytest.mark.django_db
@pytest.mark.parametrize("path", REFUSED)
def test_a_loose_pattern_still_admits_only_functions_defined_in_the_module(
    client: Client, settings: Any, path: str
) -> None:
    settings.LEASING_TASKS = LOOSE
    status, body = enqueue(client, path)
    assert status == 400, body
    assert body["field"] == "task_path"
    assert not Task.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path",
    [
        "tasks.demo.sleep",
        "tests.testapp.api_targets.public",
        "tests.testapp.api_targets.coroutine",
        "tests.testapp.api_targets.django_task",
    ],
)
def test_public_module_level_functions_and_django_tasks_are_admitted(client: Client, settings: Any, path: str) -> None:
    settings.LEASING_TASKS = LOOSE
    status, body = enqueue(client, path)
    assert status == 201, body
    assert Task.objects.get(pk=body["task"]["id"]).api_origin is True


@pytest.mark.django_db
def test_by_default_the_api_may_enqueue_nothing(client: Client, settings: Any) -> None:
    # A project of your own that names no API_TASKS: its API clients may not run the demo's handler
    # (nor anything else) until the project lists what they may enqueue.
    settings.LEASING_TASKS = {}
    for path in ("tasks.demo.sleep", "tests.testapp.api_targets.public", "tests.testapp.handlers.noop"):
        assert enqueue(client, path)[0] == 400, path
    assert not Task.objects.exists()


@pytest.mark.django_db
def test_the_demo_project_lists_its_handler_by_exact_name(client: Client) -> None:
    assert enqueue(client, "tasks.demo.sleep")[0] == 201
    for path in ("tasks.demo.sleepy", "tasks.demo.slee", "tasks.demoXsleep", "tests.testapp.api_targets.public"):
        assert enqueue(client, path)[0] == 400, path


@pytest.mark.django_db
def test_patterns_match_the_whole_path(client: Client, settings: Any) -> None:
    settings.LEASING_TASKS = {"API_TASKS": [], "API_TASK_PATTERNS": [r"tests\.testapp\.api_targets\.pub"]}
    assert enqueue(client, "tests.testapp.api_targets.public")[0] == 400  # re.match would admit it
    settings.LEASING_TASKS = {"API_TASKS": [], "API_TASK_PATTERNS": [r"tests\.testapp\.api_targets\.pub\w*"]}
    assert enqueue(client, "tests.testapp.api_targets.public")[0] == 201


def test_settings_refuse_a_broken_pattern_or_a_bare_string(settings: Any) -> None:
    from tasks.conf import get_settings

    settings.LEASING_TASKS = {"API_TASK_PATTERNS": ["tasks.demo.("]}
    with pytest.raises(ValueError, match="regex"):
        get_settings()
    settings.LEASING_TASKS = {"API_TASKS": "tasks.demo.sleep"}
    with pytest.raises(ValueError, match="list"):
        get_settings()


@pytest.mark.django_db
def test_python_enqueue_is_trusted_and_unmarked() -> None:
    # Code that enqueues from Python names its own handlers; only rows from the API are marked, and
    # the list (which a worker applies to marked rows) would refuse this one.
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop").id
    assert Task.objects.get(pk=task_id).api_origin is False
    with pytest.raises(TaskPathRefused, match="not allowed"):
        allowlist.resolve("tests.testapp.handlers.noop")


# -- the worker checks again --------------------------------------------------------------------


def finished(task_id: int) -> Task:
    return wait_until(
        lambda: Task.objects.filter(pk=task_id, status__in=["SUCCESSFUL", "FAILED"]).first(),
        20,
        what=f"task {task_id} to finish",
    )


@pytest.mark.django_db(transaction=True)
def test_worker_refuses_an_api_row_the_list_no_longer_admits_without_importing_it(settings: Any) -> None:
    assert "tests.testapp.api_canary" not in sys.modules
    settings.LEASING_TASKS = {"API_TASK_PATTERNS": [r"tests\.testapp\.handlers\.record"]}
    refused = Task.objects.enqueue("tests.testapp.api_canary.run", max_attempts=5).id
    Task.objects.filter(pk=refused).update(api_origin=True)  # as if enqueued under an older, looser list
    trusted = Task.objects.enqueue("tests.testapp.handlers.record").id  # from Python: not checked
    with worker_running():
        task = finished(refused)
        assert finished(trusted).status == "SUCCESSFUL"
    assert task.status == "FAILED"  # not retried, though 4 more attempts were allowed
    assert [e["exception_class_path"] for e in task.errors] == ["tasks.exceptions.TaskPathRefused"]
    assert "not allowed" in task.errors[0]["message"]
    assert "tests.testapp.api_canary" not in sys.modules, "the worker imported a refused path"


@pytest.mark.django_db(transaction=True)
def test_worker_runs_admitted_api_rows_and_refuses_them_once_removed(settings: Any) -> None:
    settings.LEASING_TASKS = {"API_TASK_PATTERNS": [r"tests\.testapp\.handlers\.record"]}
    client = Client()
    status, body = enqueue(client, "tests.testapp.handlers.record")
    assert status == 201
    admitted = body["task"]["id"]
    status, body = enqueue(client, "tests.testapp.handlers.record")
    later = body["task"]["id"]
    Task.objects.filter(pk=later).update(run_after="2999-01-01T00:00:00Z")
    with worker_running():
        assert finished(admitted).status == "SUCCESSFUL"
        settings.LEASING_TASKS = {"API_TASK_PATTERNS": []}  # the operator narrows the list
        Task.objects.filter(pk=later).retry_now()
        task = finished(later)
    assert task.status == "FAILED"
    assert task.errors[0]["exception_class_path"] == "tasks.exceptions.TaskPathRefused"
    assert list(Effect.objects.values_list("task_id", flat=True)) == [admitted]  # the refused one never ran


class worker_running:
    """A Worker in a thread of the test process for the duration of a ``with`` block."""

    def __init__(self) -> None:
        self.worker = Worker(
            concurrency=1, ttl=5, poll_interval=0.05, install_signal_handlers=False, worker_id="allow-1"
        )
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            self.worker.run()
        finally:
            connections.close_all()

    def __enter__(self) -> Worker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.worker.request_stop()
        self.worker.request_stop()
        self.thread.join(30)
        assert not self.thread.is_alive()
