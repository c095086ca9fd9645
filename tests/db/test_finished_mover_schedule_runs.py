"""A schedule's runs name their tasks; with the mover on by default, an interval schedule's last run's
task has left tasks_task 10-70 minutes after it finished. The schedules' JSON API and dashboard
page must show such a task's status (it is read by id from tasks_finished everywhere else), not
report it as pruned (null / "pruned")."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pytest
from django.test import Client

from tasks.models import Task
from tests.db.test_finished_mover import archive, now, roll_up_hours, where
from tests.db.test_finished_partitions import drop_partitions
from tests.db.test_schedule_pages import api_get, run_slots, schedules

pytestmark = pytest.mark.django_db(transaction=True)  # DDL of partitions

__all__ = ["schedules"]  # the autouse fixture: three schedules, an API token; ARCHIVE_AFTER its default


@pytest.fixture(autouse=True)
def no_partitions() -> Iterator[None]:
    drop_partitions()
    yield
    drop_partitions()


def moved_last_run() -> list[int]:
    ids = run_slots(3)  # ids[0] pruned
    Task.objects.filter(pk__in=ids[1:]).update(status="SUCCESSFUL", finished_at=now() - dt.timedelta(hours=3))
    roll_up_hours()
    assert archive() == 2
    assert all(where(task_id).startswith("tasks_finished_successful_") for task_id in ids[1:])  # type: ignore[union-attr]
    return ids


def test_the_schedules_api_shows_the_status_of_a_run_whose_task_moved(client: Client) -> None:
    ids = moved_last_run()
    status, detail = api_get(client, f"/api/tasks/{ids[-1]}")
    assert status == 200 and detail["task"]["status"] == "SUCCESSFUL"  # the task is there
    status, body = api_get(client, "/api/schedules")
    tick = {s["name"]: s for s in body["schedules"]}["tick"]
    assert tick["last_run"]["task_id"] == ids[-1]
    assert tick["last_run"]["task_status"] == "SUCCESSFUL", tick["last_run"]  # null reads "pruned"
    status, body = api_get(client, "/api/schedules/tick")
    statuses = {r["task_id"]: r["task_status"] for r in body["runs"]}
    assert statuses == {ids[0]: None, ids[1]: "SUCCESSFUL", ids[2]: "SUCCESSFUL"}, statuses


def test_the_schedule_page_does_not_call_a_moved_runs_task_pruned(staff: Client) -> None:
    moved_last_run()
    page = staff.get("/dashboard/schedules/tick/").content.decode()
    assert page.count("pruned") == 1, page.count("pruned")  # ids[0] only
