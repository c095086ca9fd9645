"""The admin's deletes of finished tasks on a queue database other than ``default`` (``?db=second``,
the queue "reports" routed there): a task the mover took to that database's tasks_finished is
deleted there, from its page and in a selection, and logged "deleted" on ``default``; a selection
refused whole (an unfinished task in it) deletes nothing in either database and logs nothing; the
same ids in ``default`` are never touched."""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.db import connections
from django.test import Client

from tasks.maintenance.partitions import create_ahead
from tasks.models import Task
from tests.db.test_finished_lists import MOVE_SQL
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(databases=["default", "second"]), pytest.mark.usefixtures("routes")]

UTC = dt.timezone.utc
SECOND = "_changelist_filters=db%3Dsecond"


def finished_in_second(status: str, *, moved: bool) -> int:
    """A finished task of the queue "reports" (routed to ``second``), moved to its tasks_finished
    when asked."""
    task_id = Task.objects.enqueue(NOOP, queue="reports").id
    Task.objects.using("second").filter(pk=task_id).update(
        status=status, finished_at=dt.datetime.now(UTC) - dt.timedelta(hours=3)
    )
    if moved:
        with connections["second"].cursor() as cursor:
            cursor.execute(MOVE_SQL, [[task_id]])
            assert [row[0] for row in cursor.fetchall()] == [task_id]
    return task_id


def where(task_id: int, alias: str) -> str | None:
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT 'tasks_task' FROM tasks_task WHERE id = %s UNION ALL SELECT 'tasks_finished'"
            " FROM tasks_finished WHERE id = %s",
            [task_id, task_id],
        )
        found = [row[0] for row in cursor.fetchall()]
    assert len(found) <= 1, found
    return found[0] if found else None


def logged_deleted(task_id: int) -> bool:
    return LogEntry.objects.using("default").filter(object_id=str(task_id), action_flag=DELETION).exists()


@pytest.fixture(autouse=True)
def second_days() -> None:
    """Day partitions in ``second`` from three days back (rolled back with the test)."""
    create_ahead(3, now=dt.datetime.now(UTC) - dt.timedelta(days=3), using="second")


def test_a_moved_task_is_deleted_from_its_page_in_its_own_database(staff: Client) -> None:
    task_id = finished_in_second("FAILED", moved=True)
    assert where(task_id, "second") == "tasks_finished"
    page = staff.get(f"/admin/tasks/task/{task_id}/delete/?{SECOND}")
    assert page.status_code == 200, page.content.decode()[-800:]
    response = staff.post(f"/admin/tasks/task/{task_id}/delete/?{SECOND}", {"post": "yes"}, follow=True)
    assert response.status_code == 200
    assert where(task_id, "second") is None
    assert logged_deleted(task_id)


def test_a_selection_and_a_moved_tasks_page_delete_in_their_own_database_only(staff: Client) -> None:
    moved = finished_in_second("SUCCESSFUL", moved=True)
    kept_here = finished_in_second("CANCELLED", moved=False)
    # Finished tasks of "default" with the same ids (each database has its own id sequence): a
    # delete that reached the wrong database would take them.
    bystanders = [Task.objects.using("default").enqueue(NOOP).id for _ in range(2)]
    Task.objects.using("default").filter(pk__in=bystanders).update(
        status="SUCCESSFUL", finished_at=dt.datetime.now(UTC)
    )
    with connections["default"].cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET id = id + 1000000 WHERE id = ANY(%s)", [bystanders])
        for bystander, same_id in zip(bystanders, (moved, kept_here), strict=True):
            cursor.execute("UPDATE tasks_task SET id = %s WHERE id = %s", [same_id, bystander + 1000000])
    response = staff.post(
        "/admin/tasks/task/?db=second",
        {"action": "delete_selected", "_selected_action": [kept_here], "post": "yes"},
        follow=True,
    )
    assert response.status_code == 200
    assert where(kept_here, "second") is None and logged_deleted(kept_here)
    page = staff.post(f"/admin/tasks/task/{moved}/delete/?{SECOND}", {"post": "yes"}, follow=True)
    assert page.status_code == 200
    assert where(moved, "second") is None and logged_deleted(moved)
    assert where(moved, "default") == "tasks_task" and where(kept_here, "default") == "tasks_task"


def test_a_refused_selection_deletes_nothing_in_either_database(staff: Client) -> None:
    finished = finished_in_second("FAILED", moved=False)
    unfinished = Task.objects.enqueue(NOOP, queue="reports").id  # READY in second
    response = staff.post(
        "/admin/tasks/task/?db=second",
        {"action": "delete_selected", "_selected_action": [finished, unfinished], "post": "yes"},
        follow=True,
    )
    body = response.content.decode()
    assert "Nothing deleted" in body and f"task {unfinished} is READY" in body, body[-1500:]
    assert where(finished, "second") == "tasks_task" and where(unfinished, "second") == "tasks_task"
    assert not logged_deleted(finished) and not logged_deleted(unfinished)
