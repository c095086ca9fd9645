"""The shared fair cursor's row (tasks_faircursor) held locked by another session: an API
claim of the queue that wrote it and has not committed yet (the write is inside the request's
transaction, routed()), stalled (a paused process, a slow client), or an operator's open
transaction. The cursor is advisory (tasks/models/fair_cursor.py), so its row must not gate claims:

- a real ``run_worker`` process of the fair queue must drain it at its usual pace (each write the
  dispatcher sent waited its ``lock_timeout`` on the dispatcher's own thread, between rounds);
- an API claim of the queue must return (its write had no lock_timeout: it waited for the holder
  while its own claimed rows stayed locked in its open transaction).

FAIR_CURSOR_WRITE_SQL now leaves a locked row alone (SKIP LOCKED).


Found by breaker 34 (the bug hunt on the shared fair cursor)."""

from __future__ import annotations

import threading
import time
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


def drain_seconds(workers: Workers, name: str, total: int) -> float:
    started = time.monotonic()
    # --ttl 30 (after FAST's 2): the default lease, so the dispatcher's lock_timeout is its usual 2 s
    workers.start(
        name,
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
    wait_until(lambda: done() >= total, 120, interval=0.1, what="the fair queue drained")
    seconds = time.monotonic() - started
    print(f"DRAIN {name} {seconds:.2f}")
    return seconds


def test_a_worker_drains_a_fair_queue_at_its_pace_while_the_cursor_row_is_held(
    workers: Workers, held_cursor_row: psycopg.Connection[Any]
) -> None:
    for key in KEYS:
        Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue=QUEUE, fair_key=key)
    seconds = drain_seconds(workers, "held", 5 * len(KEYS))
    # 60 noop tasks in claims of 4: well under a second of work; 15 rounds each held 2 s take 30 s
    assert seconds < 10, f"60 noop tasks took {seconds:.1f}s with the cursor row held: the write gates the rounds"


def test_the_same_drain_without_the_row_held(workers: Workers) -> None:
    """The case shows what the test above measures."""
    for key in KEYS:
        Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue=QUEUE, fair_key=key)
    seconds = drain_seconds(workers, "free", 5 * len(KEYS))
    assert seconds < 10, seconds


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
    thread.join(10)
    returned = not thread.is_alive()
    # what the waiting request holds meanwhile: its claimed row, locked by its open transaction
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND"
            " wait_event_type = 'Lock' AND query LIKE %s",
            ["%tasks_faircursor%"],
        )
        (waiting,) = cursor.fetchone()
    held_cursor_row.rollback()  # let it go, so that the thread ends
    thread.join(30)
    assert returned, (
        f"an API claim of a fair queue did not return in 10 s while another session held the cursor row "
        f"({waiting} session(s) waiting on tasks_faircursor); reply after the holder let go: {replies}"
    )
