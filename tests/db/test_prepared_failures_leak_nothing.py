"""A failed run of a prepared statement leaves no prepared statement behind on the server.

psycopg forgets a prepared statement's name when a run of it fails (its cache keeps only statements
whose last run succeeded) but does not DEALLOCATE it; the next run prepares the same text again under
a new name. Statements that fail in normal operation (a finish that meets a row lock and its
lock_timeout, an enqueue refused by the database) therefore pile up in the server session, plans
and all, for as long as the connection lives (the worker's dispatcher connection: the process's
life). Before the change nothing was prepared; after it, a bounded number (one per statement and
parameter types) is what the design expects.


Found by breaker 22 (the bug hunt on issue 22: prepared statements and pipelined bounds)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection

from leasing.bounds import bound, unbound
from tasks.models import Task
from tests.helpers import test_database_url as direct_url

pytestmark = pytest.mark.django_db(transaction=True)

RUNS = 30


def server_prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def test_a_finish_that_meets_a_row_lock_again_and_again_leaks_no_statements(fresh_session):
    """The worker's finish (bounded, pipelined) of a task whose row another session holds locked:
    each run ends in the lock_timeout (the worker retries it later)."""
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue="leak").id
    (claimed,) = Task.objects.claim("leak-w", queues=["leak"], ttl=600)
    bound(connection, statement_ms=2000, lock_ms=20)
    with psycopg.connect(direct_url()) as other:
        other.execute("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE", [task_id])
        for _ in range(RUNS):
            with pytest.raises(Exception, match="lock timeout"):
                Task.objects.complete_many("leak-w", [(claimed.id, claimed.token, "null", None)])
        other.rollback()
    assert Task.objects.complete_many("leak-w", [(claimed.id, claimed.token, "null", None)]) == {
        (claimed.id, claimed.token)
    }
    unbound(connection)
    finishes = [s for s in server_prepared() if "SUCCESSFUL" in s]
    assert len(finishes) <= 2, f"{len(finishes)} copies of the finish statement prepared on the server"


def test_enqueues_the_database_refuses_leak_no_statements(fresh_session):
    """An enqueue the database refuses (max_attempts beyond the integer column: a clear error, nothing
    stored) RUNS times on one connection."""
    for _ in range(RUNS):
        with pytest.raises(Exception, match="out of range"):
            Task.objects.enqueue("tests.testapp.handlers.noop", queue="leak", max_attempts=2**31)
    inserts = [s for s in server_prepared() if "INSERT INTO tasks_task" in s]
    assert len(inserts) <= 1, f"{len(inserts)} copies of the enqueue's INSERT prepared on the server"
