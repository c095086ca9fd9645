"""A task moved to tasks_finished once finished (issue 43) is still found by its id: by
``Task.objects.find``, a django.tasks result, ``Task.objects.wait``, the task page and the JSON API;
read-only there (history): saving or deleting it is refused, and every action on it but the rerun
(tests/db/test_finished_lists.py) answers 409 and changes nothing. Here a test moves the row as the
mover does: one statement, DELETE ... RETURNING into INSERT."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction

from tasks.compat import TaskResultDoesNotExist, TaskResultStatus
from tasks.exceptions import ArchivedTask
from tasks.models import Task
from tests.db.test_finished_lists import days, move  # noqa: F401 (days: the autouse fixture, its partitions)
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.testapp import handlers

pytestmark = pytest.mark.django_db(transaction=True)  # the wait reads on a connection of its own


def finished(value: int = 5) -> Task:
    """A django.tasks add() run to success by hand (claim, start, complete), its row in tasks_task."""
    result = handlers.add.enqueue(2, value - 2)
    [claimed] = Task.objects.claim("w1", limit=1)
    assert claimed.id == int(result.id)
    assert Task.objects.complete(claimed.id, "w1", claimed.token, value)
    return Task.objects.get(pk=claimed.id)


def test_find_reads_the_hot_table_then_the_finished_one_and_the_row_there_is_read_only() -> None:
    task = finished()
    hot = Task.objects.find(task.id)
    assert hot == task and not hot.archived
    move(task.id)
    assert not Task.objects.filter(pk=task.id).exists()
    found = Task.objects.find(task.id)
    assert found is not None and found.archived
    assert (found.status, found.return_value, found.attempts, found.task_path, found.kwargs) == (
        "SUCCESSFUL",
        5,
        1,
        task.task_path,
        task.kwargs,
    )
    assert found.finished_at == task.finished_at and found.token == task.token
    with pytest.raises(ArchivedTask):
        found.save()
    assert not Task.objects.filter(pk=task.id).exists()  # save() did not put it back
    found.delete()  # nothing to delete in tasks_task; its history stays
    assert Task.objects.find(task.id) is not None
    assert Task.objects.find(task.id + 1000) is None


def test_a_django_tasks_result_and_a_wait_find_a_moved_task() -> None:
    task = finished(7)
    move(task.id)
    result = handlers.add.get_result(str(task.id))
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 7
    with pytest.raises(TaskResultDoesNotExist):
        handlers.add.get_result(str(task.id + 1000))
    waited = Task.objects.wait(task.id, timeout=5)
    assert waited.archived and waited.return_value == 7


def test_a_wait_begun_before_the_finish_ends_when_the_task_is_moved_after_it() -> None:
    """A wait that reads the row unfinished, then finds it gone (finished and moved between two of
    its reads), reads it from tasks_finished: it returns, it does not say the task was deleted."""
    result = handlers.add.enqueue(1, 1)
    [claimed] = Task.objects.claim("w1", limit=1)
    outcome: list[Any] = []

    def wait() -> None:
        try:
            outcome.append(Task.objects.wait(claimed.id, timeout=30, poll=0.05))
        except BaseException as exc:  # pragma: no cover - reported below
            outcome.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(
        lambda: Task.objects.filter(pk=claimed.id, finish_waited=True).exists(), timeout=20, what="the wait to begin"
    )
    # Finish and move in one transaction: the wait's next read finds no row in tasks_task at all.
    with transaction.atomic():
        assert Task.objects.complete(claimed.id, "w1", claimed.token, 2)
        move(claimed.id)
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], Task), outcome
    assert outcome[0].archived and outcome[0].return_value == 2
    assert int(result.id) == claimed.id


def test_the_task_page_and_the_api_show_a_moved_task_and_refuse_every_action_on_it(client: Any, settings: Any) -> None:
    task = finished()
    move(task.id)
    client.force_login(get_user_model().objects.create_superuser("fin", "fin@example.com", "pw"))
    page = client.get(f"/dashboard/tasks/{task.id}/")
    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="task-archived"' in body and 'value="run_again"' in body  # the rerun only
    assert client.get(f"/dashboard/tasks/{task.id + 1000}/").status_code == 404
    settings.LEASING_API_TOKENS = ["t" * 40]
    api = Api(client, headers={"Authorization": f"Bearer {'t' * 40}"})
    status, reply = api.call("GET", f"/api/tasks/{task.id}")
    assert status == 200 and reply["task"]["id"] == task.id and reply["task"]["status"] == "SUCCESSFUL"
    for method, url, body in [
        ("POST", f"/api/tasks/{task.id}/cancel", None),
        ("PUT", f"/api/tasks/{task.id}/heartbeat", {"worker": "w1", "token": task.token}),
        ("PUT", f"/api/tasks/{task.id}/complete", {"worker": "w1", "token": task.token, "output": 1}),
        ("PUT", f"/api/tasks/{task.id}/fail", {"worker": "w1", "token": task.token}),
    ]:
        status, reply = api.call(method, url, body)
        assert status == 409, (url, status, reply)
        assert "finished history" in reply["error"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM tasks_task WHERE id = %s", [task.id])
        assert cursor.fetchone() == (0,)
        cursor.execute("SELECT status, finished_at FROM tasks_finished WHERE id = %s", [task.id])
        assert cursor.fetchall() == [("SUCCESSFUL", task.finished_at)]
