"""A schema change while connections hold prepared statements.

A migration that widens a column the claim returns (``AlterField(max_length=...)`` on
``Task.task_path`` is ``ALTER TABLE tasks_task ALTER COLUMN task_path TYPE varchar(300)``), applied
while workers and web processes run (a rolling deploy), changes the claim's result row type. A
statement prepared before it then fails with "cached plan must not change result type" (0A000):
PostgreSQL does not re-plan a prepared statement whose result type changed, and nothing drops it
from the session. With client-side binding (before the change) the next claim simply planned anew.


Found by breaker 22 (the bug hunt on issue 22: prepared statements and pipelined bounds)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection

from leasing.bounds import bound, unbound
from tasks.models import Task, TaskStatus
from tests.helpers import test_database_url as direct_url
from tests.helpers import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def widened() -> Iterator[psycopg.Connection]:
    """Another session (the migration's), restoring the column afterwards."""
    with psycopg.connect(direct_url(), autocommit=True) as other:
        try:
            yield other
        finally:
            other.execute("ALTER TABLE tasks_task ALTER COLUMN task_path TYPE varchar(255)")
            other.execute("ALTER TABLE tasks_task ALTER COLUMN max_attempts TYPE integer")


def test_a_web_process_claims_again_after_a_column_is_widened(widened, monkeypatch):
    """A web process serving the HTTP API's claims (``Task.objects.claim(start=True)``) on a
    persistent connection (the project's default CONN_MAX_AGE is 60): its claim, prepared before the
    ALTER, keeps failing request after request (Django keeps a connection that still answers)."""
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 60)
    connection.close()
    Task.objects.enqueue("tests.testapp.handlers.noop", queue="ddl")
    assert len(Task.objects.claim("ddl-api", queues=["ddl"], ttl=60, start=True)) == 1
    widened.execute("ALTER TABLE tasks_task ALTER COLUMN task_path TYPE varchar(300)")
    Task.objects.enqueue("tests.testapp.handlers.noop", queue="ddl")
    errors = []
    for _request in range(3):
        try:
            Task.objects.claim("ddl-api", queues=["ddl"], ttl=60, start=True)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        connection.close_if_unusable_or_obsolete()  # what Django does at the end of every request
    assert errors == [], errors


def test_a_bounded_claim_after_a_column_is_widened(widened):
    """As the worker's dispatcher sends it: with its bounds, in one pipeline."""
    bound(connection, statement_ms=5000, lock_ms=1000)
    try:
        Task.objects.enqueue("tests.testapp.handlers.noop", queue="ddl")
        assert len(Task.objects.claim("ddl-w", queues=["ddl"], ttl=60)) == 1
        widened.execute("ALTER TABLE tasks_task ALTER COLUMN task_path TYPE varchar(300)")
        Task.objects.enqueue("tests.testapp.handlers.noop", queue="ddl")
        assert len(Task.objects.claim("ddl-w", queues=["ddl"], ttl=60)) == 1
    finally:
        unbound(connection)


ALTERS = {
    # AlterField(max_length=300): the worker's statements return it through a UNION (typmod -1)
    "task_path varchar(300)": "ALTER TABLE tasks_task ALTER COLUMN task_path TYPE varchar(300)",
    # PositiveIntegerField -> PositiveBigIntegerField
    "max_attempts bigint": "ALTER TABLE tasks_task ALTER COLUMN max_attempts TYPE bigint",
}


@pytest.mark.parametrize("alter", list(ALTERS.values()), ids=list(ALTERS))
def test_a_running_worker_keeps_draining_after_a_column_is_widened(workers, widened, alter):
    """A warmed-up worker (its claim and finish statements prepared for the parameter types it
    meets), then the ALTER: every task enqueued afterwards runs exactly once and succeeds, and the
    worker meets no error doing so."""
    workers.start("ddl-0", "--queues", "ddl", "--concurrency", "2")
    for _warm in range(3):
        warm = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{"n": n} for n in range(10)], queue="ddl")
        wait_until(
            lambda: Task.objects.filter(pk__in=warm, status=TaskStatus.SUCCESSFUL).count() == len(warm),  # noqa: B023
            30,
            what="warm-up",
        )
    widened.execute(alter)
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.record", [{"n": n} for n in range(10)], queue="ddl")
    wait_until(
        lambda: (
            Task.objects.filter(pk__in=ids).exclude(status__in=[TaskStatus.READY, TaskStatus.RUNNING]).count()
            == len(ids)
        ),
        30,
        what="the tasks enqueued after the ALTER to finish",
    )
    assert Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL).count() == len(ids)
    runs = list(Effect.objects.filter(task_id__in=ids, phase="done").values_list("task_id", flat=True))
    assert sorted(runs) == sorted(ids), "each task ran exactly once"
    assert "cached plan" not in workers.log("ddl-0"), workers.log("ddl-0")[-4000:]
