"""``connection_errors`` counts connections that failed, and only those (tasks/worker/writer.py
``retrying``): a statement cut short by a lock wait, refused for its data, or chosen as a deadlock's
victim met a working connection. Real locks from a second connection, no mocks."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from django.db import connection

from tasks.models import Task
from tasks.worker.process import Worker
from tasks.worker.session import retrying
from tests.helpers import test_database_url as database_url
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def other_connection() -> psycopg.Connection[Any]:
    return psycopg.connect(database_url().replace("postgres://", "postgresql://", 1))


def worker() -> Worker:
    return Worker(concurrency=1, ttl=5, install_signal_handlers=False, worker_id="counted")


def test_a_lock_wait_and_a_refused_statement_are_not_connection_errors() -> None:
    task_id = Task.objects.enqueue(NOOP).id
    counted = worker()
    calls: list[str] = []

    def locked() -> None:
        calls.append("locked")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '100ms'")
            cursor.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [task_id])

    with other_connection() as holder:
        holder.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [task_id])
        assert retrying("locking a row", counted.session, locked) is None  # not retried at once: it would wait again
        holder.rollback()

    def refused() -> int:
        calls.append("refused")
        return Task.objects.filter(queue="nul\x00").count()

    assert retrying("reading a NUL", counted.session, refused) is None
    assert calls == ["locked", "refused"]
    assert counted.stats["connection_errors"] == 0


def test_a_deadlock_victim_is_retried_and_not_counted_as_a_connection_error() -> None:
    """The statement locks row a then row b; another session holds b and then asks for a. PostgreSQL
    picks our statement as the victim (it has waited longest): its transaction is rolled back on a
    working connection, and the retry succeeds once the other session commits."""
    a, b = (Task.objects.enqueue(NOOP).id for _ in range(2))
    counted = worker()
    backend: list[int] = []
    calls: list[int] = []

    def both_rows() -> int:
        calls.append(1)
        with connection.cursor() as cursor:
            cursor.execute("SET deadlock_timeout = '100ms'")
            backend[:] = [connection.connection.info.backend_pid]
            # One statement locks a, then b (rows are locked in the order the sort gives them).
            cursor.execute("SELECT id FROM tasks_task WHERE id IN (%s, %s) ORDER BY id FOR UPDATE", [a, b])
            return len(calls)

    errors: list[BaseException] = []

    def other() -> None:
        try:
            with other_connection() as session:
                session.execute("SET deadlock_timeout = '10s'")  # never the one that detects it
                session.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [b])
                holding.set()
                wait_until(lambda: waiting_on_lock(session), what="our statement to wait for row b")
                session.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [a])
                session.commit()
        except BaseException as exc:
            errors.append(exc)
            raise

    def waiting_on_lock(session: psycopg.Connection[Any]) -> bool:
        if not backend:
            return False
        row = session.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [backend[0]]).fetchone()
        return row is not None and row[0] == "Lock"

    holding = threading.Event()
    thread = threading.Thread(target=other)
    thread.start()
    assert holding.wait(10)
    try:
        assert retrying("locking two rows", counted.session, both_rows) == 2  # the victim, then the retry
    finally:
        thread.join(30)
    assert not errors
    assert counted.stats["connection_errors"] == 0
