"""Deleting tasks from the admin (issue 38, item 4): only a finished task (SUCCESSFUL, FAILED,
CANCELLED) is deleted, the "delete" transition of tasks/lifecycle/transitions.py. An unfinished one
(a RUNNING attempt above all, or one still waiting) is refused with a message saying to cancel it
first, and a refused request changes nothing: no row gone, no "deleted" log entry. The bulk action
refuses a selection with an unfinished task whole. The check and the delete are one statement
(TaskQuerySet.delete_finished): a task requeued by another session while the delete waits for its
row is not deleted. The JSON API has no delete of a task at all."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.contrib.admin import site as admin_site
from django.contrib.admin.models import LogEntry
from django.db import connection, connections
from django.test import Client, RequestFactory

from tasks.exceptions import TaskNotFinished
from tasks.models import Failure, Task
from tasks.workflows import chain, step
from tests.factories import StaffFactory
from tests.helpers import wait_until
from tests.helpers.api import check_answer
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/admin/tasks/task/"


def told(response: Any) -> str:
    return " ".join(str(m) for m in response.context["messages"]) if response.context else ""


def one_of_each() -> dict[str, int]:
    """A task in every status an operator may try to delete."""
    Task.objects.enqueue(NOOP, concurrency_key="one", concurrency_limit=1, priority=-5)  # holds the key's slot
    ids = {
        "READY": Task.objects.enqueue(NOOP).id,
        "RUNNING": Task.objects.enqueue(NOOP, priority=9).id,
        "BLOCKED": Task.objects.enqueue(NOOP, concurrency_key="one", concurrency_limit=1, priority=-5).id,
    }
    [running] = Task.objects.claim("admin-delete-worker", limit=1)
    assert running.id == ids["RUNNING"]
    flow = chain(step(NOOP), step(NOOP)).enqueue()
    ids["AWAITING"] = flow.task_ids[1]
    for status in ("SUCCESSFUL", "FAILED", "CANCELLED"):
        ids[status] = Task.objects.enqueue(NOOP, priority=-50).id
        Task.objects.filter(pk=ids[status]).update(status=status)
    statuses = dict(Task.objects.filter(pk__in=ids.values()).values_list("pk", "status"))
    assert {statuses[task_id] for task_id in ids.values()} == set(ids), statuses
    return {status: task_id for status, task_id in ids.items() if statuses[task_id] == status}


def snapshot() -> tuple[list[tuple[int, str]], int]:
    rows = list(Task.objects.order_by("pk").values_list("pk", "status"))
    return rows, LogEntry.objects.count()


def test_an_unfinished_task_is_not_deleted_and_the_admin_says_why(staff: Client) -> None:
    ids = one_of_each()
    before = snapshot()
    for status in ("RUNNING", "READY", "BLOCKED", "AWAITING"):
        task_id = ids[status]
        for method in ("get", "post"):
            response = getattr(staff, method)(f"{URL}{task_id}/delete/", {"post": "yes"}, follow=True)
            assert response.status_code == 200, (status, method)
            assert response.redirect_chain[-1][0] == f"{URL}{task_id}/change/" or response.redirect_chain[-1][
                0
            ].startswith(f"{URL}{task_id}/change/?"), response.redirect_chain
            message = told(response)
            assert f"Nothing deleted: task {task_id} is {status}" in message, message
            assert "cancel it first" in message
        change = staff.get(f"{URL}{task_id}/change/").content.decode()
        assert f"{URL}{task_id}/delete/" not in change  # no delete button on an unfinished task
    assert snapshot() == before
    # A running attempt deleted would have left its worker holding nothing: it is still there, still its.
    assert Task.objects.get(pk=ids["RUNNING"]).holder == "admin-delete-worker"


def test_a_finished_task_is_deleted_and_logged(staff: Client) -> None:
    ids = one_of_each()
    for status in ("SUCCESSFUL", "FAILED", "CANCELLED"):
        response = staff.post(f"{URL}{ids[status]}/delete/", {"post": "yes"})
        assert response.status_code == 302 and response["Location"] == URL, (status, response)
        assert not Task.objects.filter(pk=ids[status]).exists()
    assert LogEntry.objects.filter(object_id__in=[str(ids[s]) for s in ("SUCCESSFUL", "FAILED", "CANCELLED")]).count()
    # The cancel action then the delete: the way to remove a running task.
    staff.post(URL, {"action": "cancel", "_selected_action": [ids["RUNNING"]]})
    assert staff.post(f"{URL}{ids['RUNNING']}/delete/", {"post": "yes"}).status_code == 302
    assert not Task.objects.filter(pk=ids["RUNNING"]).exists()


def test_the_bulk_delete_refuses_a_selection_with_an_unfinished_task_whole(staff: Client) -> None:
    ids = one_of_each()
    before = snapshot()
    selection = [ids["SUCCESSFUL"], ids["RUNNING"], ids["FAILED"], ids["READY"]]
    for confirmed in ({}, {"post": "yes"}):
        response = staff.post(
            URL, {"action": "delete_selected", "_selected_action": selection, **confirmed}, follow=True
        )
        assert response.status_code == 200
        message = told(response)
        assert (
            f"Nothing deleted: task {ids['READY']} is READY, task {ids['RUNNING']} is RUNNING" in message
            or f"Nothing deleted: task {ids['RUNNING']} is RUNNING, task {ids['READY']} is READY" in message
        ), message
        assert "cancel them first" in message
    assert snapshot() == before
    # Only finished ones selected: Django's confirmation page, then the delete, logged.
    finished = [ids["SUCCESSFUL"], ids["FAILED"], ids["CANCELLED"]]
    page = staff.post(URL, {"action": "delete_selected", "_selected_action": finished})
    assert page.status_code == 200 and b"Are you sure" in page.content
    done = staff.post(URL, {"action": "delete_selected", "_selected_action": finished, "post": "yes"}, follow=True)
    assert "Successfully deleted 3" in told(done)
    assert not Task.objects.filter(pk__in=finished).exists()
    assert LogEntry.objects.count() == before[1] + 3


def test_a_task_that_became_unfinished_after_the_page_checked_it_is_kept_with_no_log_entry(
    staff: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The page's check passes (as for a task finished when the operator opened it, requeued before
    # the delete runs): the conditional DELETE refuses it, and the view's "deleted" log entry, written
    # before the delete in the same transaction, is rolled back with it.
    ids = one_of_each()
    model_admin = admin_site._registry[Task]
    monkeypatch.setattr(type(model_admin), "has_delete_permission", lambda self, request, obj=None: True)
    before = snapshot()
    response = staff.post(f"{URL}{ids['RUNNING']}/delete/", {"post": "yes"}, follow=True)
    assert f"Nothing deleted: task {ids['RUNNING']} is RUNNING" in told(response)
    selection = [ids["SUCCESSFUL"], ids["READY"], ids["CANCELLED"]]
    with pytest.raises(TaskNotFinished) as refused:
        model_admin.delete_queryset(RequestFactory().post(URL), Task.objects.filter(pk__in=selection))
    assert refused.value.unfinished == [(ids["READY"], "READY")]
    assert snapshot() == before


def test_the_delete_reads_the_status_a_concurrent_requeue_commits() -> None:
    # Another session requeues a failed task and holds its row; the delete waits for the row lock,
    # then reads the committed status (READY) and deletes nothing, the other finished task included.
    failed = Task.objects.enqueue(NOOP, max_attempts=1).id
    done = Task.objects.enqueue(NOOP).id
    [claimed] = Task.objects.claim("w", limit=1, queues=["default"])
    Task.objects.fail(Failure(claimed.id, claimed.token, "x.Boom", "boom", ""), "w")
    Task.objects.filter(pk=done).update(status="SUCCESSFUL")
    assert Task.objects.get(pk=failed).status == "FAILED"
    other = connections.create_connection("default")
    outcome: list[Any] = []
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute("UPDATE tasks_task SET status = 'READY', finished_at = NULL WHERE id = %s", [failed])

        def delete() -> None:
            try:
                outcome.append(Task.objects.filter(pk__in=[failed, done]).delete_finished())
            except TaskNotFinished as exc:
                outcome.append(exc)
            finally:
                connections.close_all()

        thread = threading.Thread(target=delete)
        thread.start()

        def waiting() -> bool:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND"
                    " wait_event_type = 'Lock' AND query LIKE %s",
                    ["%picked AS MATERIALIZED%"],
                )
                return bool(cursor.fetchone()[0])

        wait_until(waiting, 30, what="the delete to wait for the requeued row")
        other.commit()
        thread.join(30)
    finally:
        other.close()
    [error] = outcome
    assert isinstance(error, TaskNotFinished) and error.unfinished == [(failed, "READY")], outcome
    assert set(Task.objects.filter(pk__in=[failed, done]).values_list("pk", flat=True)) == {failed, done}


def test_the_json_api_has_no_delete_of_a_task(client: Client) -> None:
    running = Task.objects.enqueue(NOOP).id
    Task.objects.claim("w", limit=1)
    client.force_login(StaffFactory.create())
    for url in (f"/api/tasks/{running}", f"/api/tasks/{running}/cancel", "/api/tasks"):
        response = client.delete(url)
        assert response.status_code == 405, (url, response.status_code)
        assert "DELETE" not in response["Allow"]
        check_answer(response)
    assert Task.objects.get(pk=running).status == "RUNNING"
