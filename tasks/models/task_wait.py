"""Waiting for a task to finish (``Task.objects.wait(task_id, timeout=10)``; a django.tasks result's
``wait()`` calls it). Async code waits on its event loop instead, with these statements
(tasks/models/task_await.py).

On a connection of its own (autocommit: never inside the caller's transaction, whose locks would
hold the worker's finish back), the wait LISTENs on ``leasing_task_finished`` where the alias allows
it (tasks/lifecycle/listening.py: not pooled, or a direct URL in LISTEN_URLS), then marks the row
(``finish_waited``) and reads its status in the same statement. From then on the row's move to a
final status NOTIFYs its id (the trigger of migration 0030), so the wait wakes as the finish
commits. Behind a transaction pooler it polls instead, every 0.05 s doubling up to ``poll`` seconds.
The mark skips a row another transaction holds locked (the wait polls, and marks it on a later
read): waiting for that lock would hold the wait past its timeout. A task nobody waits for is never
marked and its finish notifies nobody.

A timeout raises :class:`~tasks.exceptions.TaskWaitTimeout` and leaves the task alone (still
marked: its finish sends one notification nobody reads).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import connections

from tasks.exceptions import TaskError, TaskWaitTimeout
from tasks.lifecycle.listening import through_a_pooler, wakeup_for
from tasks.lifecycle.states import FINISHED
from tasks.models.finished import FINISHED_STATUS_SQL
from tasks.models.task_send import OperationsBase

if TYPE_CHECKING:
    from collections.abc import Callable

FINISHED_CHANNEL = "leasing_task_finished"
#: Marks the row waited for and reads its status: (status, marked); no row: no such task where
#: this connection looks. The mark never waits for a row lock (SKIP LOCKED): another transaction
#: holding the row (a ``select_for_update()``, an operator's bulk action) would hold an UPDATE, and
#: the wait with it, past its timeout. A row it could not mark is read all the same, and marked on a
#: later read; until then its finish notifies nobody, so the wait polls.
MARK_WAITED_SQL = """
WITH marked AS (
    UPDATE tasks_task SET finish_waited = true
    WHERE id = (SELECT id FROM tasks_task WHERE id = %(id)s FOR NO KEY UPDATE SKIP LOCKED)
    RETURNING status
)
SELECT COALESCE((SELECT status FROM marked), t.status), EXISTS (SELECT FROM marked)
FROM tasks_task AS t WHERE t.id = %(id)s
"""
# A waiter's read once its wait is marked (finish_waited), after each notification or poll pause: the
# status alone, by primary key.
READ_STATUS_SQL = "SELECT status FROM tasks_task WHERE id = %s"
#: The first pause of a wait that polls; it doubles up to the ``poll`` argument.
FIRST_POLL = 0.05


class WaitOperations(OperationsBase):
    """Waiting for a task to finish. A base of TaskQuerySet: its methods are ``Task.objects``'s."""

    def wait(self, task_id: int, *, timeout: float | None = None, poll: float = 1.0) -> Any:
        """The task's row once it is final (SUCCESSFUL, FAILED or CANCELLED), read on this queryset's
        database; :class:`~tasks.exceptions.TaskWaitTimeout` after ``timeout`` seconds (None: no
        limit), the task untouched. ``poll``: the longest pause between two reads where no
        notification can come (a pooled alias without a direct URL), or between two checks of a
        wait that has one (a lost notification costs at most that)."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0 or None, not {timeout!r}")
        using = self.db
        deadline = None if timeout is None else time.monotonic() + timeout
        listening, connect = _connection(using, poll)
        try:
            with connect() as conn:
                if listening and through_a_pooler(conn):
                    listening = False  # an undeclared pooler: its LISTEN would be lost
                if listening:
                    conn.execute(f"LISTEN {FINISHED_CHANNEL}")
                row = conn.execute(MARK_WAITED_SQL, {"id": task_id}).fetchone()
                if row is None:  # moved to tasks_finished: final
                    row = _finished_status(conn, task_id)
                if row is None:
                    raise self.model.DoesNotExist(not_in_database(task_id, using))
                status, marked = row
                pause = FIRST_POLL
                while status not in FINISHED:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TaskWaitTimeout(task_id, status, timeout or 0.0)
                    step = poll if left is None else min(poll, left)
                    if listening and marked:
                        for _ in conn.notifies(timeout=step, stop_after=1):
                            pass  # any finish wakes the read below (payload: the id; ours or not)
                    else:
                        time.sleep(min(pause, step))
                        pause = min(pause * 2, poll)
                    if marked:
                        found = conn.execute(READ_STATUS_SQL, [task_id]).fetchone()
                    else:
                        found = conn.execute(MARK_WAITED_SQL, {"id": task_id}).fetchone()
                        marked = bool(found and found[1])
                    if found is None:  # moved to tasks_finished once final, or deleted
                        found = _finished_status(conn, task_id)
                    if found is None:
                        raise self.model.DoesNotExist(f"task {task_id} was deleted while it was waited for")
                    status = found[0]
        except psycopg.Error as exc:
            raise TaskError(f"waiting for task {task_id}: the database refused: {exc}") from exc
        task = self.model.objects.db_manager(using).find(task_id)
        if task is None:
            raise self.model.DoesNotExist(f"task {task_id} was deleted once it finished")
        return task


def _finished_status(conn: psycopg.Connection, task_id: int) -> tuple[str, bool] | None:
    """(status, not marked) of the task's row in tasks_finished: final; None: not there either."""
    found = conn.execute(FINISHED_STATUS_SQL, [task_id]).fetchone()
    return None if found is None else (found[0], False)


def _connection(using: str, poll: float) -> tuple[bool, Callable[[], psycopg.Connection]]:
    """(whether it can LISTEN, a function opening an autocommit connection to the alias's database)."""
    wake = wakeup_for(using, poll)
    if wake.connect is not None:
        return True, wake.connect
    wrapper = connections[using]

    def pooled() -> psycopg.Connection:
        conn: psycopg.Connection = wrapper.get_new_connection(wrapper.get_connection_params())
        conn.autocommit = True
        return conn

    return False, pooled


def not_in_database(task_id: int, using: str) -> str:
    """Why a wait found no task: the sync and the async wait say it alike."""
    return (
        f"task {task_id} is not in database {using!r} (or not yet visible: an enqueue inside a"
        " transaction is seen once it commits; wait after the commit, e.g. in transaction.on_commit)"
    )
