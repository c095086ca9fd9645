"""A bulk retry reaches the finished tasks the mover took to tasks_finished (issue 43): each batch's
statement picks the matching ids of its window from both tables, brings the moved ones back to
tasks_task as they were and requeues them in its transaction, with honest counts; a moved task whose
dedup key an unfinished task holds is skipped and stays where it was; an operator's rerun of a moved
task racing a batch (two real connections) runs it once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, transaction

from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Task
from tests.db.test_finished_lists import days, ended, move, where  # noqa: F401 (days: the autouse fixture, its partitions)
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # DDL of partitions, real second connections


def failed_tasks() -> dict[str, list[int]]:
    """Failed tasks of queue "bulk", moved and not, their ids interleaved; and a moved one elsewhere."""
    ids: dict[str, list[int]] = {"hot": [], "moved": [], "other": []}
    for k in range(8):
        ids["moved" if k % 2 == 0 else "hot"].append(ended("FAILED", queue="bulk"))
    ids["other"].append(ended("FAILED", queue="elsewhere"))
    move(*ids["moved"], *ids["other"])
    return ids


def test_a_bulk_retry_brings_back_and_reruns_the_moved_tasks_it_matches(settings: Any) -> None:
    settings.LEASING_TASKS = {"BULK_BATCH_SIZE": 3, "BULK_SPAN": 4}  # several batches and windows
    ids = failed_tasks()
    operation = BulkOperation.objects.request("retry", {"queue": "bulk"}, requested_by="ops")
    BulkRunner().run_until_idle()
    operation.refresh_from_db()
    assert (operation.status, operation.matched, operation.changed, operation.skipped) == ("DONE", 8, 8, 0)
    for task_id in ids["hot"] + ids["moved"]:
        task = Task.objects.get(pk=task_id)
        assert (where(task_id), task.status, task.attempts) == ("tasks_task", "READY", 0)
    assert where(ids["other"][0]) == "tasks_finished"  # not matched: left in the history


def test_the_window_jumps_the_gap_the_mover_left_to_reach_the_moved_tasks(settings: Any) -> None:
    """Everything older than the hot table's first row is in tasks_finished: the window's first id is
    the lower of both tables', not tasks_task's (which would start past every moved task)."""
    settings.LEASING_TASKS = {"BULK_BATCH_SIZE": 2, "BULK_SPAN": 2}
    moved = [ended("FAILED", queue="bulk") for _ in range(3)]
    move(*moved)
    with connection.cursor() as cursor:  # a gap of ids, as retention and the mover leave
        cursor.execute("SELECT setval('tasks_task_id_seq', nextval('tasks_task_id_seq') + 10000)")
    hot = ended("FAILED", queue="bulk")
    operation = BulkOperation.objects.request("retry", {"queue": "bulk"}, requested_by="ops")
    BulkRunner().run_until_idle()
    operation.refresh_from_db()
    assert (operation.status, operation.matched, operation.changed) == ("DONE", 4, 4)
    assert operation.batches <= 4  # the gap jumped in one probe, not walked 2 ids at a time
    assert all(where(task_id) == "tasks_task" for task_id in [*moved, hot])


def test_a_moved_task_whose_dedup_key_is_held_is_skipped_and_stays_in_the_history(settings: Any) -> None:
    settings.LEASING_TASKS = {"BULK_BATCH_SIZE": 10}
    ids = failed_tasks()
    keyed = ended("FAILED", queue="bulk", dedup_key="invoice-3")
    move(keyed)
    holder = Task.objects.enqueue(NOOP, queue="other", dedup_key="invoice-3").id
    operation = BulkOperation.objects.request("retry", {"queue": "bulk"}, requested_by="ops")
    BulkRunner().run_until_idle()
    operation.refresh_from_db()
    assert (operation.status, operation.matched, operation.changed, operation.skipped) == ("DONE", 9, 8, 1)
    assert where(keyed) == "tasks_finished" and Task.objects.find(keyed).status == "FAILED"
    assert Task.objects.get(pk=holder).status == "READY"
    assert all(Task.objects.get(pk=i).status == "READY" for i in ids["hot"] + ids["moved"])


def test_an_operator_rerunning_a_moved_task_while_a_batch_reaches_it_runs_it_once() -> None:
    """The operator's restore and requeue hold the row (their transaction open); the batch's statement
    picked it from tasks_finished and waits for it, then finds it gone: skipped, not changed; the
    operator's rerun stands, the task READY once, in tasks_task only."""
    ids = failed_tasks()
    target = ids["moved"][1]
    operation = BulkOperation.objects.request("retry", {"queue": "bulk"}, requested_by="ops")
    held, release = threading.Event(), threading.Event()

    def operator() -> int:
        with transaction.atomic():
            assert Task.objects.restore([target]) == [target]
            changed = Task.objects.filter(pk=target).requeue()
            held.set()
            release.wait(60)
            return changed

    rerun = OnItsOwnConnection(operator)
    rerun.start()
    assert held.wait(30)
    batch = OnItsOwnConnection(lambda: operation.run_batch(batch=100, span=1_000_000))
    batch.start()
    wait_until(lambda: waits_for_a_lock(batch.pid), 30, what="the batch to wait for the operator's row")
    release.set()
    assert rerun.outcome() == 1
    result = batch.outcome()
    assert result is not None and (result.batch_picked, result.batch_changed) == (8, 7)
    assert where(target) == "tasks_task" and Task.objects.get(pk=target).status == "READY"
    assert all(Task.objects.get(pk=i).status == "READY" for i in ids["hot"] + ids["moved"])


def test_a_batch_redone_a_row_at_a_time_whose_rows_all_went_meanwhile_moves_on() -> None:
    """The row-at-a-time redo of a retry's batch (its statement collided on a dedup key) picks its
    window again; when every row it had went in between (moved and then deleted, or pruned), it
    runs the batch's own statement, which has nothing left to collide on, and reports what that did:
    nothing picked, the cursor past the window, the operation done. (Its result was built from all
    the statement's columns where a batch's result has seven: a TypeError.)"""
    ids = failed_tasks()
    operation = BulkOperation.objects.request("retry", {"queue": "bulk"}, requested_by="ops")
    with connection.cursor() as cursor:  # gone from both tables, as a prune or an operator's delete
        cursor.execute("DELETE FROM tasks_task WHERE id = ANY(%s)", [ids["hot"]])
        cursor.execute("DELETE FROM tasks_finished WHERE id = ANY(%s)", [ids["moved"]])
    result = operation.retry_one_at_a_time("default", operation.batch_params(batch=100, span=20_000))
    assert result is not None
    assert (result.batch_picked, result.batch_changed, result.changed, result.skipped) == (0, 0, 0, 0)
    assert result.cursor >= max(ids["hot"] + ids["moved"])
    BulkRunner().run_until_idle()
    operation.refresh_from_db()
    assert (operation.status, operation.changed) == ("DONE", 0)
    assert where(ids["other"][0]) == "tasks_finished"
