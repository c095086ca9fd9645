"""Issue 41's attempts table attacked with an operator's cancel of a running attempt (dashboard,
admin, API, a workflow's cancel: ``Task.cancel``): the attempt ends there, its worker's late result
is refused, and the table must say it was cancelled, never that it returned, whether it is the last
attempt or one before a Retry; plus a mix of entries written before ``position`` existed (crafted
with an UPDATE) and new ones, and a position that names another worker's attempt."""

from __future__ import annotations

import pytest
from django.db import connection

from tasks.models import Failure, Task
from tests.db.test_attempt_history_attacks import QUEUE, claim, end, succeed, table

pytestmark = pytest.mark.django_db

PATH = "tests.testapp.handlers.noop"


def cancel_running(task_id: int, worker: str) -> None:
    """An attempt started by ``worker`` that an operator cancels; the worker's late failure is refused."""
    token = claim(task_id, worker)
    assert Task.objects.filter(pk=task_id).cancel() == 1
    late = Failure(task_id, token, "builtins.RuntimeError", "too late", "", kind="fail")
    assert not Task.objects.fail(late, worker)


def test_an_operator_cancel_of_the_last_attempt_is_its_outcome() -> None:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=3).id
    end(task_id, "w1", "first failure")
    cancel_running(task_id, "w2")
    assert [(n, o) for n, o, _ in table(task_id)] == [(1, "Failed"), (2, "Cancelled")]


def test_an_operator_cancel_before_a_retry_stays_cancelled() -> None:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=3).id
    succeed(task_id, "w1")
    assert Task.objects.filter(pk=task_id).requeue() == 1  # Run again
    cancel_running(task_id, "w2")
    assert Task.objects.filter(pk=task_id).requeue() == 1  # Retry the cancelled task
    succeed(task_id, "w3")
    assert [(n, o) for n, o, _ in table(task_id)] == [(1, "Successful"), (2, "Cancelled"), (3, "Successful")]


def test_old_entries_without_position_and_new_ones_each_attempt_once_in_order() -> None:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=20).id
    for number in range(1, 4):
        end(task_id, f"w{number}", f"old {number}")
    # As written before issue 41: no position.
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET errors = (SELECT jsonb_agg(e - 'position' ORDER BY n) FROM "
            "jsonb_array_elements(errors) WITH ORDINALITY AS x(e, n)) WHERE id = %s",
            [task_id],
        )
    succeed_then = Task.objects.get(pk=task_id)
    assert all("position" not in e for e in succeed_then.errors)
    for number in range(4, 7):
        end(task_id, "w1", f"new {number}")
    rows = table(task_id)
    assert [(n, o, m) for n, o, m in rows] == [(n, "Failed", f"{'old' if n < 4 else 'new'} {n}") for n in range(1, 7)]


def test_a_position_naming_another_workers_attempt_is_not_trusted() -> None:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=20).id
    for number in range(1, 5):
        end(task_id, f"w{number}", f"failure {number}")
    # The newest entry's position points at attempt 2 (worker w2), though w4 wrote it.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET errors = jsonb_set(errors, '{3,position}', '2') WHERE id = %s", [task_id])
    rows = table(task_id)
    assert [(n, o, m) for n, o, m in rows] == [(n, "Failed", f"failure {n}") for n in range(1, 5)]


def test_snoozes_between_twelve_failures_with_dropped_and_old_entries() -> None:
    """Twelve attempts by twelve workers, a snooze after each (which takes its own worker id back),
    two entries dropped (the first and the newest nine kept), and the first two kept entries
    rewritten as before ``position`` existed: attempts 2 and 3 are "Not known", the rest their own."""
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=20).id
    for number in range(1, 13):
        end(task_id, f"w{number}", f"failure {number}")
        end(task_id, f"s{number}", "nap", kind="snooze", delay=0)
    task = Task.objects.get(pk=task_id)
    assert task.errors_dropped == 2 and task.worker_ids == [f"w{n}" for n in range(1, 13)]
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET errors = jsonb_set(jsonb_set(errors, '{0}', (errors->0) - 'position'),"
            " '{1}', (errors->1) - 'position') WHERE id = %s",
            [task_id],
        )
    rows = table(task_id)
    unknown = "Not known (its error entry was dropped)"
    assert rows == [
        (1, "Failed", "failure 1"),
        (2, unknown, None),
        (3, unknown, None),
        *[(n, "Failed", f"failure {n}") for n in range(4, 13)],
    ]


def test_an_operator_cancel_past_ten_entries_keeps_the_cap_and_its_attempt() -> None:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=20).id
    for number in range(1, 11):
        end(task_id, f"w{number}", f"failure {number}")
    cancel_running(task_id, "w11")
    task = Task.objects.get(pk=task_id)
    assert len(task.errors) == 10 and task.errors_dropped == 1
    assert task.errors[-1]["kind"] == "cancel" and task.errors[-1]["position"] == 11
    rows = table(task_id)
    assert rows[0] == (1, "Failed", "failure 1")
    assert rows[1][1].startswith("Not known")
    assert rows[2:] == [*[(n, "Failed", f"failure {n}") for n in range(3, 11)], (11, "Cancelled", rows[10][2])]
    # Waiting tasks cancelled by an operator get no entry: no attempt of theirs ended.
    waiting = Task.objects.enqueue(PATH, queue=QUEUE).id
    assert Task.objects.filter(pk=waiting).cancel() == 1
    assert Task.objects.get(pk=waiting).errors == []


def test_a_claim_not_started_yet_is_no_running_attempt() -> None:
    """A worker claims ahead (a batch waits in its local queue, not started): the task is RUNNING,
    but its last attempt in ``worker_ids`` is the one that returned before "Run again"."""
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=3).id
    succeed(task_id, "w1")
    assert Task.objects.filter(pk=task_id).requeue() == 1  # Run again
    token = claim(task_id, "w2", start=False)
    assert [(n, o) for n, o, _ in table(task_id)] == [(1, "Successful")]
    assert Task.objects.start(task_id, "w2", token) is not None
    assert [(n, o) for n, o, _ in table(task_id)] == [(1, "Successful"), (2, "Running")]
