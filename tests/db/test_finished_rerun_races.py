"""A rerun of a moved task composed with the readers and the mover (issue 43), on real second
connections. The move is not one way any more: a rerun (``Task.objects.restore`` then the requeue,
one transaction) brings a row back from tasks_finished to tasks_task. So:

- a listing reads both tables in one statement (one snapshot): a row restored between a read of
  tasks_task and a read of tasks_finished would be in neither (the page misses a task that exists
  all along); the rows of a page, read table by table, look in tasks_task once more for an id found
  in neither (restored meanwhile);
- a rerun whose restore ran while the mover held the row (the move not committed: nothing to
  restore yet) finds the row gone when its requeue has waited for the mover, and restores and
  requeues it then, instead of refusing an operator's rerun of a finished task as "history";
- a rerun keeps the task's keys exact: a concurrency key's slots, a fair queue, a debounce key, a
  task someone waits on; the task runs once."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.test import Client

from tasks.maintenance.archive import ARCHIVE_SQL
from tasks.maintenance.partitions import create_day
from tasks.models import Task
from tasks.testing.inline import run_until_empty
from tasks.web.listings import Listing
from tests.db.test_finished_lists import days, ended, move, where  # noqa: F401 (days: the autouse fixture, its partitions)
from tests.helpers import wait_until
from tests.helpers.api import TOKEN, Api
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # real second connections; DDL of partitions

UTC = dt.timezone.utc


@pytest.fixture
def api_on(settings: Any, client: Client) -> Api:
    settings.LEASING_API_TOKENS = [TOKEN]
    return Api(client)


def rerun_while_the_finished_table_is_locked(task_id: int, read: Any) -> Any:
    """``read()`` on its own connection, held at tasks_finished by a lock this connection takes; while
    it waits there, this connection reruns ``task_id`` (restore and requeue) and commits. What
    ``read`` returned."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("LOCK TABLE tasks_finished IN ACCESS EXCLUSIVE MODE")
        reader = OnItsOwnConnection(read)
        reader.start()
        wait_until(lambda: waits_for_a_lock(reader.pid), 20, what="the reader to reach tasks_finished")
        assert Task.objects.restore([task_id]) == [task_id]
        assert Task.objects.filter(pk=task_id).requeue() == 1
    return reader.outcome()


def test_a_page_lists_a_task_rerun_while_it_reads() -> None:
    """Every status's page: the moved task is read where it is when the page's one statement reads,
    never in neither table. (Read as two statements, tasks_task first, the rerun committed between
    them took it out of tasks_finished after tasks_task had been read: the page left it out.)"""
    ended("SUCCESSFUL")
    task_id = ended("FAILED")
    ended("SUCCESSFUL")
    move(task_id)
    page = rerun_while_the_finished_table_is_locked(task_id, lambda: Listing(Task.objects.all()).page(limit=10))
    assert [(t.pk, t.status) for t in page.tasks if t.pk == task_id] == [(task_id, "READY")]
    assert where(task_id) == "tasks_task"


def test_the_rows_of_a_page_find_a_task_rerun_between_their_two_reads() -> None:
    task_id = ended("FAILED")
    move(task_id)
    listing = Listing(Task.objects.all())
    rows = rerun_while_the_finished_table_is_locked(task_id, lambda: listing.rows([task_id]))
    assert [(t.pk, t.status, t.archived) for t in rows] == [(task_id, "READY", False)]


def hold_a_move(task_id: int) -> psycopg.Connection[Any]:
    """A mover's batch that has taken ``task_id`` (moved, not committed), on a connection of its own."""
    t0 = Task.objects.get(pk=task_id).finished_at
    assert t0 is not None
    create_day("FAILED", t0.astimezone(UTC).date())
    mover = psycopg.connect(**connection.get_connection_params(), autocommit=True)
    mover.execute("BEGIN")
    batch = {
        "status": "FAILED",
        "since": t0 - dt.timedelta(days=1),
        "until": t0 + dt.timedelta(seconds=1),
        "after_at": dt.datetime(1, 1, 1, tzinfo=UTC),
        "after_id": 0,
        "limit": 10,
    }
    moved = [row[1] for row in mover.execute(ARCHIVE_SQL, batch).fetchall()]
    assert moved == [task_id], moved
    return mover


def rerun_beside_a_held_move(task_id: int, rerun: Any) -> Any:
    mover = hold_a_move(task_id)
    try:
        operator = OnItsOwnConnection(rerun)
        operator.start()
        wait_until(lambda: waits_for_a_lock(operator.pid), 20, what="the rerun to wait for the mover's batch")
        mover.execute("COMMIT")
        return operator.outcome()
    finally:
        mover.close()


def test_a_rerun_from_the_dashboard_while_the_mover_takes_the_task_reruns_it(staff: Client) -> None:
    """The rerun's restore finds nothing (the move uncommitted), its requeue waits for the batch and
    finds the row gone: it is in tasks_finished now, restored and requeued then; 302, the task READY
    in tasks_task once."""
    task_id = ended("FAILED", at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
    response = rerun_beside_a_held_move(
        task_id, lambda: staff.post("/dashboard/tasks/action/", {"action": "retry", "ids": [task_id]})
    )
    assert response.status_code == 302, response.content.decode()[-600:]
    assert where(task_id) == "tasks_task" and Task.objects.get(pk=task_id).status == "READY"


def test_a_rerun_from_the_api_while_the_mover_takes_the_task_reruns_it(api_on: Api) -> None:
    """The API read the task in tasks_task (not yet moved for it), then its requeue found it gone."""
    task_id = ended("FAILED", at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
    status, reply = rerun_beside_a_held_move(task_id, lambda: api_on.call("POST", f"/api/tasks/{task_id}/requeue"))
    assert status == 200, reply
    assert reply["task"]["status"] == "READY" and reply["task"]["archived"] is False
    assert where(task_id) == "tasks_task"


def test_a_requeue_from_the_admin_while_the_mover_takes_the_task_reruns_it(staff: Client) -> None:
    """The admin read the selected row in tasks_task (its move not committed), its requeue waited for
    the batch and found it gone: restored from tasks_finished then and requeued, counted."""
    task_id = ended("FAILED", at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
    response = rerun_beside_a_held_move(
        task_id,
        lambda: staff.post("/admin/tasks/task/", {"action": "requeue", "_selected_action": [task_id]}, follow=True),
    )
    assert "Requeued 1 finished task(s)." in response.content.decode()
    assert where(task_id) == "tasks_task" and Task.objects.get(pk=task_id).status == "READY"


def test_a_delete_of_a_selection_confirmed_while_the_mover_takes_one_deletes_both(staff: Client) -> None:
    """The admin read both selected rows in tasks_task (the move not committed), its delete waited for
    the mover's batch and found one gone: it is deleted from tasks_finished then, where it went, and
    the message counts both. (The delete of tasks_task alone said "deleted" and kept it.)"""
    taken = ended("FAILED", at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
    other = ended("SUCCESSFUL")
    response = rerun_beside_a_held_move(
        taken,
        lambda: staff.post(
            "/admin/tasks/task/",
            {"action": "delete_selected", "_selected_action": [taken, other], "post": "yes"},
            follow=True,
        ),
    )
    assert "Successfully deleted 2 tasks." in response.content.decode(), response.content.decode()[-1500:]
    assert where(taken) is None and where(other) is None


def test_a_delete_from_a_tasks_page_confirmed_while_the_mover_takes_it_deletes_it(staff: Client) -> None:
    taken = ended("FAILED", at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
    response = rerun_beside_a_held_move(
        taken, lambda: staff.post(f"/admin/tasks/task/{taken}/delete/", {"post": "yes"}, follow=True)
    )
    assert "was deleted successfully" in response.content.decode(), response.content.decode()[-1500:]
    assert where(taken) is None


def slots_taken(key: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT (SELECT count(*) FROM tasks_task WHERE concurrency_key = %s AND status IN ('READY', 'RUNNING'))"
            " + (SELECT count(*) FROM tasks_concurrencyhold WHERE key = %s)",
            [key, key],
        )
        return int(cursor.fetchone()[0])


def ran(drained: Any) -> list[int]:
    return sorted(drained.task_ids)  # an id twice: it ran twice


def test_a_rerun_of_a_moved_keyed_task_waits_for_its_key_and_runs_once(api_on: Api) -> None:
    """The restore is an insert into tasks_task (the key's insert trigger fires on a finished row: no
    slot), the requeue makes it wait for the key: BLOCKED while another task holds the one slot,
    admitted when it finishes; the key's slots stay exact."""
    done = Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=1).id
    assert ran(run_until_empty()) == [done]
    move(done)
    busy = Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=1).id
    assert Task.objects.get(pk=busy).status == "READY" and slots_taken("k") == 1
    status, reply = api_on.call("POST", f"/api/tasks/{done}/requeue")
    assert status == 200 and reply["task"]["status"] == "BLOCKED", reply
    assert slots_taken("k") == 1
    assert ran(run_until_empty()) == sorted([done, busy])
    assert slots_taken("k") == 0
    assert [Task.objects.get(pk=i).status for i in (done, busy)] == ["SUCCESSFUL", "SUCCESSFUL"]


@pytest.mark.usefixtures("fair_queues")
def test_a_rerun_of_a_moved_fair_queue_task_runs_once(staff: Client) -> None:
    keyed = Task.objects.enqueue(NOOP, queue="fair", fair_key="tenant-1").id
    assert ran(run_until_empty(["fair"])) == [keyed]
    move(keyed)
    response = staff.post("/dashboard/tasks/action/", {"action": "run_again", "ids": [keyed]})
    assert response.status_code == 302, response.content.decode()[-600:]
    assert Task.objects.get(pk=keyed).fair_key == "tenant-1"
    assert ran(run_until_empty(["fair"])) == [keyed]


def test_a_rerun_of_a_moved_debounced_task_runs_once_beside_a_new_debounce(api_on: Api) -> None:
    """A debounced task moved and run again comes back as a rerun in place does: started once
    (transitions), it no longer takes in the key's later enqueues, which make a task of their own;
    each runs once."""
    first = Task.objects.enqueue(NOOP, debounce=60, dedup_key="d-1").id
    Task.objects.filter(pk=first).retry_now()
    assert ran(run_until_empty()) == [first]
    move(first)
    status, reply = api_on.call("POST", f"/api/tasks/{first}/requeue")
    assert status == 200, reply
    second = Task.objects.enqueue(NOOP, debounce=60, dedup_key="d-1")
    assert second.created and second.id != first
    Task.objects.filter(pk=second.id).retry_now()
    assert ran(run_until_empty()) == sorted([first, second.id])


def test_a_wait_on_a_rerun_moved_task_ends_when_it_finishes_again(api_on: Api) -> None:
    task_id = Task.objects.enqueue(NOOP).id
    assert ran(run_until_empty()) == [task_id]
    move(task_id)
    status, _ = api_on.call("POST", f"/api/tasks/{task_id}/requeue")
    assert status == 200
    waiter = OnItsOwnConnection(lambda: Task.objects.wait(task_id, timeout=30).status)
    waiter.start()
    wait_until(lambda: Task.objects.get(pk=task_id).finish_waited, 20, what="the wait to mark the task")
    assert ran(run_until_empty()) == [task_id]
    assert waiter.outcome() == "SUCCESSFUL"


def test_a_lookup_by_id_finds_a_task_rerun_between_its_two_probes(api_on: Api) -> None:
    """``Task.objects.find`` (the task page, the API's task, a django.tasks result) probes tasks_task,
    then tasks_finished: a rerun committed between the two is found in tasks_task, not "no such task"."""
    task_id = ended("FAILED")
    move(task_id)
    found = rerun_while_the_finished_table_is_locked(task_id, lambda: Task.objects.find(task_id))
    assert found is not None and (found.pk, found.status, found.archived) == (task_id, "READY", False)
    status, reply = api_on.call("GET", f"/api/tasks/{task_id}")
    assert status == 200 and reply["task"]["archived"] is False


def test_a_retry_of_hot_and_moved_tasks_while_the_mover_takes_one_reruns_each_once_and_counts_them(
    staff: Client,
) -> None:
    """Retry over a failed task in tasks_task, one moved before and one the mover's batch holds (moved,
    not committed): the requeue waits for the batch, comes back short, and the restore brings both
    moved rows back; 302, "Retry: 3 task(s).", each READY in tasks_task once, each run once."""
    three_hours_ago = dt.datetime.now(UTC) - dt.timedelta(hours=3)
    moved_before = ended("FAILED", at=three_hours_ago - dt.timedelta(hours=1))
    move(moved_before)
    held = ended("FAILED", at=three_hours_ago)
    hot = ended("FAILED")
    selection = [hot, moved_before, held]
    response = rerun_beside_a_held_move(
        held, lambda: staff.post("/dashboard/tasks/action/", {"action": "retry", "ids": selection})
    )
    assert response.status_code == 302, response.content.decode()[-600:]
    assert "Retry: 3 task(s)." in staff.get(response["Location"]).content.decode()
    for task_id in selection:
        assert where(task_id) == "tasks_task" and Task.objects.get(pk=task_id).status == "READY"
    assert sorted(run_until_empty().task_ids) == sorted(selection)  # each once
    assert Task.objects.filter(pk__in=selection, status="SUCCESSFUL").count() == 3


def test_a_retry_of_hot_and_moved_tasks_refused_for_a_taken_key_or_a_missing_id_changes_nothing(
    staff: Client,
) -> None:
    """A moved task's dedup key held by a waiting task (409 naming it), or an id that names no task
    (409 naming it, and only it): the hot task stays failed, the moved one in tasks_finished, nothing in both tables."""
    hot = ended("FAILED")
    keyed = ended("FAILED", dedup_key="invoice-12")
    plain = ended("FAILED")
    move(keyed, plain)
    holder = Task.objects.enqueue(NOOP, dedup_key="invoice-12").id
    taken = staff.post("/dashboard/tasks/action/", {"action": "retry", "ids": [hot, keyed, plain]})
    assert taken.status_code == 409 and f"task {holder}" in taken.content.decode()
    missing = staff.post("/dashboard/tasks/action/", {"action": "retry", "ids": [hot, plain, 2**62]})
    assert missing.status_code == 409
    # Named as they were before the request's statements (the hot task it had requeued is no reason).
    assert f"tasks only: no task {2**62}. Nothing changed." in missing.content.decode()
    assert where(hot) == "tasks_task" and Task.objects.get(pk=hot).status == "FAILED"
    assert where(keyed) == where(plain) == "tasks_finished"
    assert Task.objects.find(keyed).status == Task.objects.find(plain).status == "FAILED"
