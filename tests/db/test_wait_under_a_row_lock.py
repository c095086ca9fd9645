"""A wait's timeout holds while another transaction holds the task's row lock: the wait marks the
row it waits for (an UPDATE), and an UPDATE waits for a row lock without end. An application
transaction that locks the task (``select_for_update()``, an operator's bulk action in flight) made
``result.wait(timeout=0.5)`` block until that transaction ended, however long.

Found attacking issue 40 on Python 3.10, Django 5.2 and PostgreSQL 15."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from tasks.exceptions import TaskWaitTimeout
from tasks.models import Task, TaskStatus
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("lock", ["FOR UPDATE", "FOR NO KEY UPDATE", "FOR SHARE"])
def test_a_wait_times_out_while_another_transaction_holds_the_row(lock: str) -> None:
    task_id = Task.objects.enqueue(NOOP, queue="locked").id
    release = threading.Event()

    def hold() -> None:
        with transaction.atomic():
            list(Task.objects.raw(f"SELECT * FROM tasks_task WHERE id = %s {lock}", [task_id]))
            held.result = True
            release.wait(60)  # a hang guard: the test releases it once the wait ended

    held = OnItsOwnConnection(hold)
    held.result = None
    held.start()
    held.ready.wait(10)
    try:
        wait_until(lambda: held.result, 10, what="the row lock to be taken")
        waiter = OnItsOwnConnection(lambda: Task.objects.wait(task_id, timeout=0.5, poll=0.1))
        waiter.start()
        # The timeout is half a second; the holder keeps its lock until the wait has ended (or its
        # own minute has passed: then the wait waited for it, and the check below fails).
        waiter.join(120)
        assert not waiter.is_alive(), "the wait outlived its timeout behind another transaction's row lock"
        assert isinstance(waiter.error, TaskWaitTimeout), waiter.error
        # It timed out while the row was still locked: the holder's transaction is still open.
        assert row_locked_by(held.pid), "the wait ended only once the holder's transaction had ended"
    finally:
        release.set()
        held.join(30)
    assert Task.objects.get(pk=task_id).status == TaskStatus.READY


def row_locked_by(pid: int | None) -> bool:
    """The backend ``pid`` is still inside its transaction (the one that locked the row)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND xact_start IS NOT NULL", [pid])
        return bool(cursor.fetchone()[0])
