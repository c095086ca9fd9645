"""A unique_for window outlives the 10-70 minutes a finished task stays in tasks_task now that the
mover is on by default: a duplicate enqueue through the JSON API or the django.tasks backend must
answer with the task that opened the window, wherever it lives (tasks_finished once moved), as the
queryset's enqueue does (tests/db/test_finished_mover_compositions.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tasks.models import Task, UniqueKey
from tests.db.test_finished_mover import archive, mover_on, now, roll_up_hours, where
from tests.db.test_unique_windows import backend_settings
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # DDL of partitions

__all__ = ["mover_on"]  # the autouse fixture: the mover on, partitions dropped around each test


def finish_three_hours_ago_and_move(task_id: int) -> None:
    Task.objects.filter(pk=task_id).update(
        status="SUCCESSFUL", finished_at=now() - dt.timedelta(hours=3), return_value=task_id
    )
    roll_up_hours()
    assert archive() == 1
    assert where(task_id).startswith("tasks_finished_")  # type: ignore[union-attr]


def test_the_api_answers_a_duplicate_with_the_moved_task_that_opened_the_window(task_api: Api) -> None:
    status, first = task_api.enqueue({"task_path": NOOP, "dedup_key": "nightly:7", "unique_for": 86400})
    assert status == 201
    finish_three_hours_ago_and_move(first["task_id"])
    status, again = task_api.enqueue({"task_path": NOOP, "dedup_key": "nightly:7", "unique_for": 86400})
    assert (status, again["created"], again["task_id"]) == (200, False, first["task_id"])
    # The task exists (GET /api/tasks/<id> reads it from tasks_finished): the answer must show it,
    # not null as for a task retention pruned.
    status, detail = task_api.call("GET", f"/api/tasks/{first['task_id']}")
    assert status == 200 and detail["task"]["status"] == "SUCCESSFUL"
    assert again["task"] is not None, "the duplicate's answer says the window's task is gone; it was moved"
    assert again["task"]["status"] == "SUCCESSFUL"


def test_the_backend_answers_a_duplicate_with_the_moved_tasks_result(settings: Any) -> None:
    from tests.conformance.tasks import noop_task

    backend = backend_settings(settings, unique={noop_task.module_path: {"key": "noop:{0}", "for": 86400}})
    first = noop_task.enqueue(1)
    finish_three_hours_ago_and_move(int(first.id))
    assert backend.get_result(first.id).status == "SUCCESSFUL"  # get_result reads both tables
    again = noop_task.enqueue(1, 2)
    assert again.id == first.id and UniqueKey.objects.get(key="noop:1").task_id == int(first.id)
    # "A duplicate ... returns the existing task's result": the moved task finished, its arguments [1].
    assert (again.status, again.args) == ("SUCCESSFUL", [1]), (again.status, again.args)
