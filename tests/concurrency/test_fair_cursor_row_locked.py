"""The shared fair cursor's row (tasks_faircursor) held locked by another session: an API
claim of the queue that wrote it and has not committed yet (the write is inside the request's
transaction, routed()), stalled (a paused process, a slow client), or an operator's open
transaction. The cursor is advisory (tasks/models/fair_cursor.py), so its row must not gate claims:

- a real ``run_worker`` process of the fair queue must drain it without waiting on the row (each write the
  dispatcher sent waited its ``lock_timeout`` on the dispatcher's own thread, between rounds);
- an API claim of the queue must return (its write had no lock_timeout: it waited for the holder
  while its own claimed rows stayed locked in its open transaction).

FAIR_CURSOR_WRITE_SQL now leaves a locked row alone (SKIP LOCKED).


Found by breaker 34 (the bug hunt on the shared fair cursor)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, connections

from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fair_queue_api")]

QUEUE = "fair"
KEYS = [f"t{n:02d}" for n in range(12)]


@pytest.fixture
def held_cursor_row() -> Iterator[psycopg.Connection[Any]]:
    """Another session holding the queue's cursor row locked, as a claimer's uncommitted write does."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_faircursor (queue, fair_after, updated_at) VALUES (%s, 't05', now())", [QUEUE]
        )
    holder = psycopg.connect(**connection.get_connection_params())
    holder.execute("SELECT 1 FROM tasks_faircursor WHERE queue = %s FOR UPDATE", [QUEUE])
    yield holder
    holder.rollback()
    holder.close()


def done() -> int:
    return Task.objects.filter(queue=QUEUE, status="SUCCESSFUL").count()


def waiting_on_the_cursor_row() -> int:
    """Sessions of the test database waiting on a row lock in a statement that names the cursor table."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND"
            " pid <> pg_backend_pid() AND wait_event_type = 'Lock' AND query LIKE %s",
            ["%tasks_faircursor%"],
        )
        (waiting,) = cursor.fetchone()
    return int(waiting)


def test_a_worker_drains_a_fair_queue_without_waiting_on_the_held_cursor_row(
    workers: Workers, held_cursor_row: psycopg.Connection[Any]
) -> None:
    """No speed is read: the verdict is whether any statement ever waits on the held row. Before the
    fix every round's cursor write waited its 2 s lock_timeout on it (15 rounds, 30 s of waiting in
    a drain of well under a second), so a 0.1 s poll saw a waiter on nearly every reading; a write
    that skips the locked row never waits, so no reading can see one, however slow the machine."""
    for key in KEYS:
        Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue=QUEUE, fair_key=key)
    # --ttl 30 (after FAST's 2): the default lease, so the dispatcher's lock_timeout is its usual 2 s
    workers.start(
        "held",
        "--queues",
        QUEUE,
        "--concurrency",
        "4",
        "--batch-size",
        "4",
        "--ttl",
        "30",
        "--no-scheduler",
        LEASING_TEST_FAIR_QUEUES=QUEUE,
    )
    waits: list[int] = []

    def drained_or_waiting() -> bool:
        waiting = waiting_on_the_cursor_row()
        if waiting:
            waits.append(waiting)
        return bool(waiting) or done() >= 5 * len(KEYS)

    wait_until(drained_or_waiting, 120, interval=0.1, what="the fair queue drained (or a wait on its cursor row)")
    assert not waits, f"a statement waited on the held cursor row: the write gates the rounds ({waits})"
    assert done() == 5 * len(KEYS)
    # the cursor row was never written while held (a plain read does not wait on the lock)
    with connection.cursor() as cursor:
        cursor.execute("SELECT fair_after FROM tasks_faircursor WHERE queue = %s", [QUEUE])
        assert cursor.fetchone() == ("t05",)


def test_an_api_claim_returns_while_the_cursor_row_is_held(
    client: Any, held_cursor_row: psycopg.Connection[Any]
) -> None:
    for key in KEYS:
        Task.objects.bulk_enqueue(NOOP, [{}], queue=QUEUE, fair_key=key)
    api = Api(client)
    replies: list[tuple[int, Any]] = []

    def claim() -> None:
        try:
            replies.append(api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": [QUEUE]}))
        finally:
            connections.close_all()

    thread = threading.Thread(target=claim, daemon=True)
    thread.start()
    waits: list[int] = []

    def returned_or_waiting() -> bool:
        waiting = waiting_on_the_cursor_row()
        if waiting:
            waits.append(waiting)
        return bool(waiting) or not thread.is_alive()

    # no speed is read: before the fix the request's write waited on the row with no lock_timeout
    # (a waiter on every reading until the holder let go); after it, no statement ever waits
    wait_until(returned_or_waiting, 120, interval=0.1, what="the API claim to return (or wait on the cursor row)")
    held_cursor_row.rollback()  # let it go, so that a waiting thread ends
    thread.join(30)
    assert not waits, (
        f"an API claim of a fair queue waited on the cursor row another session held ({waits} session(s) "
        f"waiting on tasks_faircursor); reply after the holder let go: {replies}"
    )
    [(status, body)] = replies
    assert status == 200, body
