"""The connection that ``async def`` handlers' ORM calls use.

Django's async ORM methods (``aget``, ``aexists``, ...) run on asgiref's one thread-sensitive thread,
on a connection of that thread's own (docs/explanation/fault-model.md). The executor threads call
``close_old_connections()`` after every handler and close their connections when they end; the event
loop's database threads are closed at stop (``AsyncExecutor._close_pool_connections``). Nothing does
either for the thread-sensitive thread, so its connection is never checked nor replaced: once the
server drops it (a restart, a failover, ``pg_terminate_backend``, an idle timeout of a pooler), every
later async ORM call of every coroutine in the worker fails on the dead connection, attempt after
attempt, until the process restarts. Invariant 7 (nothing stuck) and 9 (the worker goes on serving).


Found by breaker 21 (the bug hunt on issue 21: the worker rebuilt from small parts)."""

from __future__ import annotations

import pytest
from django.db import connection

from tasks.models import Task, TaskStatus
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."


def terminate_worker_backends() -> int:
    """What a database restart does to a worker's connections (the test's own is spared)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        return int(cursor.fetchone()[0])


def test_async_orm_calls_recover_after_the_server_drops_the_connections(workers: Workers) -> None:
    Gate.objects.create(key="open", open=True)
    first = Task.objects.enqueue(H + "async_gate", kwargs={"gate": "open"}).id
    workers.start("aorm", "--async-concurrency", "4", "--concurrency", "1")
    wait_until(lambda: Task.objects.filter(pk=first, status=TaskStatus.SUCCESSFUL).exists(), 20, what="first task")

    assert terminate_worker_backends() >= 1

    later = Task.objects.enqueue(H + "async_gate", kwargs={"gate": "open"}, max_attempts=3).id
    wait_until(
        lambda: Task.objects.filter(pk=later, status__in=[TaskStatus.SUCCESSFUL, TaskStatus.FAILED]).exists(),
        30,
        what="the later task to end",
    )
    task = Task.objects.get(pk=later)
    errors = [(e.get("exception_class_path"), (e.get("message") or "")[:120]) for e in task.errors]
    assert task.status == TaskStatus.SUCCESSFUL, f"{task.status} after {task.attempts} attempts: {errors}"
