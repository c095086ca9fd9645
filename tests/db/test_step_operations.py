"""What an operator and a deploy do to a task's durable steps (tasks/steps.py): re-run it from a step
(the Python call, the JSON API, the task page's button), and patch markers (``patched``) that let new
code take a new path only in tasks that had not gone past it.

Each verdict is a state or a count: which steps' effects ran how often, which steps are stored."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from tasks.exceptions import TaskError
from tasks.maintenance.archive import Archiver
from tasks.models import Task, TaskStep
from tasks.runtime import _set_current
from tasks.steps import patched, rerun_from_step, step
from tests.db.test_steps import attempt, effect
from tests.factories import StaffFactory
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "steps"
STEPPED = "tests.testapp.handlers.stepped"


def names(task_id: int) -> list[str]:
    return list(TaskStep.objects.filter(task_id=task_id).order_by("position").values_list("name", flat=True))


def effects(task_id: int) -> list[str]:
    return sorted(Effect.objects.filter(task_id=task_id).values_list("phase", flat=True))


@pytest.fixture
def worker(settings: Any) -> Iterator[Any]:
    from tasks.worker.process import Worker
    from tests.helpers import worker_in_thread

    settings.LEASING_TASKS = {"BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05, "ARCHIVE_AFTER": None}
    running = Worker(concurrency=1, ttl=5, poll_interval=0.05, install_signal_handlers=False, worker_id="rerun")
    with worker_in_thread(running):
        yield running


def successful(task_id: int) -> Task:
    return wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 60, what="the task")


def test_a_finished_task_re_run_from_a_step_runs_that_step_and_after_and_not_before(worker: Any) -> None:
    task_id = Task.objects.enqueue(STEPPED, max_attempts=3).id
    successful(task_id)
    assert effects(task_id) == ["step-one", "step-two"]
    assert rerun_from_step(task_id, 1) == 1
    wait_until(lambda: Effect.objects.filter(task_id=task_id, phase="step-two").count() == 2, 60, what="the rerun")
    task = successful(task_id)
    assert effects(task_id) == ["step-one", "step-two", "step-two"], "step one came back stored; two ran again"
    assert names(task_id) == ["one", "two"]
    assert task.return_value == [{"phase": "step-one", "attempt": 1}, {"phase": "step-two", "attempt": 2}]


def test_a_task_the_mover_took_comes_back_to_re_run_from_a_step(current: None, settings: Any) -> None:
    from tests.db.test_finished_mover import roll_up_hours
    from tests.db.test_finished_partitions import drop_partitions

    drop_partitions()
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "10m"}
    try:
        task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
        _set_current(attempt(task_id, "w1"))
        step("one", effect, "one")
        step("two", effect, "two")
        _set_current(None)
        three_hours_ago = timezone.now() - dt.timedelta(hours=3)
        Task.objects.filter(pk=task_id).update(
            status="SUCCESSFUL", finished_at=three_hours_ago, expires_at=three_hours_ago, released_at=three_hours_ago
        )
        roll_up_hours()  # the mover moves only what the history's counted hours hold
        assert Archiver(interval=0.0).run_for(60.0) == 1
        assert Task.objects.find(task_id).archived
        assert rerun_from_step(task_id, 1) == 1
        row = Task.objects.get(pk=task_id)  # back in tasks_task
        assert (row.status, row.finished_at) == ("READY", None)
        assert names(task_id) == ["one"]
    finally:
        drop_partitions()


def test_what_a_re_run_cannot_fit_is_refused_and_changes_nothing(current: None) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    _set_current(attempt(task_id, "w1"))
    step("one", effect, "one")
    step("two", effect, "two")
    with pytest.raises(TaskError, match="running"):
        rerun_from_step(task_id, 0)
    _set_current(None)
    Task.objects.filter(pk=task_id).update(status="FAILED", finished_at=timezone.now())
    for position in (-1, 3, True, "1"):
        with pytest.raises(ValueError, match=r"position|stored steps"):
            rerun_from_step(task_id, position)  # type: ignore[arg-type]
    with pytest.raises(Task.DoesNotExist):
        rerun_from_step(task_id + 1000, 0)
    assert names(task_id) == ["one", "two"]
    assert Task.objects.get(pk=task_id).status == "FAILED"
    assert rerun_from_step(task_id, 2) == 0, "from past the last step: nothing discarded, run again"
    assert Task.objects.get(pk=task_id).status == "READY"


def test_a_re_run_a_dedup_key_refuses_keeps_its_steps(current: None) -> None:
    first = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE, dedup_key="k").id
    _set_current(attempt(first, "w1"))
    step("one", effect, "one")
    _set_current(None)
    Task.objects.filter(pk=first).update(status="FAILED", finished_at=timezone.now())
    Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE, dedup_key="k")  # holds the key now
    with pytest.raises(TaskError):
        rerun_from_step(first, 0)
    assert names(first) == ["one"]
    assert Task.objects.get(pk=first).status == "FAILED"


def test_the_api_re_runs_from_a_step_and_answers_what_it_cannot(client: Client, api_token: None) -> None:
    api = Api(client)
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    execution = attempt(task_id, "w1")
    _set_current(execution)
    try:
        step("one", effect, "one")
    finally:
        _set_current(None)
    url = f"/api/tasks/{task_id}/rerun-from-step"
    assert api.call("POST", url, {"position": 0})[0] == 409, "running"
    Task.objects.filter(pk=task_id).update(status="SUCCESSFUL", finished_at=timezone.now())
    for bad in ({}, {"position": -1}, {"position": "0"}, {"position": 2}, {"position": 0, "x": 1}):
        status, body = api.call("POST", url, bad)
        assert status == 400, (bad, body)
    assert api.call("POST", f"/api/tasks/{task_id + 1000}/rerun-from-step", {"position": 0})[0] == 404
    status, body = api.call("POST", url, {"position": 0})
    assert (status, body["discarded"], body["task"]["status"]) == (200, 1, "READY")
    assert names(task_id) == []


def test_the_task_page_offers_a_re_run_from_each_step_but_while_it_runs(client: Client) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    execution = attempt(task_id, "w1")
    _set_current(execution)
    try:
        step("one", effect, "one")
        step("two", effect, "two")
    finally:
        _set_current(None)
    client.force_login(StaffFactory.create())
    page = f"/dashboard/tasks/{task_id}/"
    assert "Re-run from here" not in client.get(page).content.decode(), "running: its attempt holds its steps"
    action = f"/dashboard/tasks/{task_id}/rerun-from-step/"
    refused = client.post(action, {"position": "1"})
    assert refused.status_code == 409 and "running" in refused.content.decode()
    Task.objects.filter(pk=task_id).update(status="CANCELLED", finished_at=timezone.now())
    html = client.get(page).content.decode()
    assert html.count("Re-run from here") == 2
    assert client.post(action, {"position": "x"}).status_code == 400
    done = client.post(action, {"position": "1"})
    assert (done.status_code, done["Location"]) == (302, page)
    assert names(task_id) == ["one"]
    assert Task.objects.get(pk=task_id).status == "READY"
    client.force_login(StaffFactory.create(is_superuser=False))  # staff without the change permission
    assert client.post(action, {"position": "0"}).status_code == 403
    assert names(task_id) == ["one"]


def again(task_id: int) -> None:
    """The task's attempt crashed: waiting again (its lease lapsed)."""
    Task.objects.filter(pk=task_id).update(status="READY", expires_at=timezone.now() - dt.timedelta(seconds=5))


def test_a_patch_marker_takes_the_new_path_only_where_no_older_step_was_recorded(current: None) -> None:
    new = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    _set_current(attempt(new, "w1"))
    step("reserve", effect, "reserve")
    assert patched("tax-2027")
    step("total", effect, "total-new")
    assert names(new) == ["reserve", "patch:tax-2027", "total"]
    _set_current(None)
    # A task that ran the old code past the point: its next attempt stays on the old path.
    old = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    _set_current(attempt(old, "w2"))
    step("reserve", effect, "reserve")
    step("total", effect, "total-old")
    _set_current(None)
    again(old)
    _set_current(attempt(old, "w3"))
    step("reserve", effect, "reserve")
    assert not patched("tax-2027")
    assert step("total", effect, "total-new") == {"phase": "total-old", "count": 1}, "the old path's stored step"
    _set_current(None)
    again(new)
    _set_current(attempt(new, "w4"))
    step("reserve", effect, "reserve")
    assert patched("tax-2027"), "a task that took the new path keeps it"
    assert step("total", effect, "total-new") == {"phase": "total-new", "count": 1}
    assert names(new) == ["reserve", "patch:tax-2027", "total"]
