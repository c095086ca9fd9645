"""An admin delete confirmed while a rerun brings the task back says what happened: a task the delete
did not delete (a rerun restored and requeued it first: READY in tasks_task) is neither reported
"deleted" nor logged as a deletion. Real connections: the mover's batch held on one, the rerun on
another, the admin's request on a third."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.db import connection, transaction
from django.test import Client

from tasks.models import Task
from tests.db.test_finished_lists import days, ended, move, where  # noqa: F401 (days: the autouse fixture)
from tests.db.test_finished_rerun_races import hold_a_move
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)

UTC = dt.timezone.utc


def rerun(task_id: int, *, behind_the_finished_table: bool, then_cancel: bool = False) -> None:
    """The dashboard's rerun of a moved task (restore, then requeue, one transaction); first taking
    tasks_finished whole when asked (queued behind the mover's batch, so it runs before the admin's
    delete of tasks_finished, which reaches that table only after the batch commits). With
    ``then_cancel`` the new run finishes at once (CANCELLED, in tasks_task) in the same window."""
    with transaction.atomic():
        if behind_the_finished_table:
            with connection.cursor() as cursor:
                cursor.execute("LOCK TABLE tasks_finished IN EXCLUSIVE MODE")
        assert Task.objects.restore([task_id]) == [task_id]
        assert Task.objects.filter(pk=task_id).requeue() == 1
        if then_cancel:
            assert Task.objects.filter(pk=task_id).cancel() == 1


def said_and_logged(response: Any, task_id: int) -> tuple[str, bool]:
    body = response.content.decode()
    said = "deleted" if ("was deleted successfully" in body or "Successfully deleted" in body) else "not deleted"
    logged = LogEntry.objects.filter(object_id=str(task_id), action_flag=DELETION).exists()
    return said, logged


def test_a_delete_from_a_moved_tasks_page_confirmed_while_a_rerun_restores_it_does_not_say_deleted(
    staff: Client,
) -> None:
    """The admin reads the task in tasks_finished (the rerun's restore is not committed), its delete
    there waits for the rerun and finds the row gone: the task is READY in tasks_task."""
    task_id = ended("FAILED", at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
    move(task_id)
    with transaction.atomic():
        assert Task.objects.restore([task_id]) == [task_id]
        assert Task.objects.filter(pk=task_id).requeue() == 1
        admin = OnItsOwnConnection(
            lambda: staff.post(f"/admin/tasks/task/{task_id}/delete/", {"post": "yes"}, follow=True)
        )
        admin.start()
        wait_until(lambda: waits_for_a_lock(admin.pid), 20, what="the admin's delete to wait for the rerun")
    response = admin.outcome()
    assert where(task_id) == "tasks_task" and Task.objects.get(pk=task_id).status == "READY"
    assert said_and_logged(response, task_id) == ("not deleted", False), response.content.decode()[-1500:]


@pytest.mark.parametrize("finished_again", [False, True], ids=["ready-again", "finished-again"])
@pytest.mark.parametrize("how", ["page", "selection"])
def test_a_delete_confirmed_while_the_mover_takes_the_task_and_a_rerun_brings_it_back_does_not_say_deleted(
    staff: Client, how: str, finished_again: bool
) -> None:
    """The admin reads the task in tasks_task (the move is not committed); its delete there waits for
    the mover's batch and finds the row gone; the rerun (queued on tasks_finished behind the batch)
    restores and requeues it before the admin's delete of tasks_finished runs: nothing is deleted.
    Also when the new run has finished again (cancelled) by then: the delete finds it in neither
    place it looked, and the new run is not deleted unseen."""
    task_id = ended("FAILED", at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
    other = ended("SUCCESSFUL")
    mover = hold_a_move(task_id)
    try:
        if how == "page":
            request = lambda: staff.post(f"/admin/tasks/task/{task_id}/delete/", {"post": "yes"}, follow=True)  # noqa: E731
        else:
            request = lambda: staff.post(  # noqa: E731
                "/admin/tasks/task/",
                {"action": "delete_selected", "_selected_action": [task_id, other], "post": "yes"},
                follow=True,
            )
        admin = OnItsOwnConnection(request)
        admin.start()
        wait_until(lambda: waits_for_a_lock(admin.pid), 20, what="the admin's delete to wait for the mover")
        operator = OnItsOwnConnection(
            lambda: rerun(task_id, behind_the_finished_table=True, then_cancel=finished_again)
        )
        operator.start()
        wait_until(lambda: waits_for_a_lock(operator.pid), 20, what="the rerun to queue behind the mover")
        mover.execute("COMMIT")
        operator.outcome()
        response = admin.outcome()
    finally:
        mover.close()
    status = "CANCELLED" if finished_again else "READY"
    assert where(task_id) == "tasks_task" and Task.objects.get(pk=task_id).status == status
    assert said_and_logged(response, task_id) == ("not deleted", False), response.content.decode()[-1500:]
    body = response.content.decode()
    assert (f"task {task_id} ran again and is CANCELLED" in body) == finished_again, body[-1500:]
    if how == "selection":  # refused whole: the other finished task of the selection stays too
        assert where(other) == "tasks_task"
