"""A fair queue's turn cursor shared by every claimer of the database (tasks/models/fair_cursor.py,
tasks_faircursor): read once when a claimer starts claiming, written back when it moved at most once
per interval and at a clean stop, never a statement per claim; last writer wins. Workers and API
processes start their turns where it says instead of at the first key every life (breaker 33)."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from django.db import connection

from tasks.lifecycle import statements as sql
from tasks.models import FairCursor, SharedFairCursor, Task
from tests.helpers import wait_until, worker_in_thread
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fair_queue_api")]

KEYS = [f"t{n:02d}" for n in range(12)]


def enqueue_tenants(per_key: int = 2) -> None:
    for key in KEYS:
        Task.objects.bulk_enqueue(NOOP, [{}] * per_key, queue="fair", fair_key=key)


def stored(queue: str = "fair") -> str | None:
    return FairCursor.objects.filter(queue=queue).values_list("fair_after", flat=True).first()


@pytest.mark.django_db(transaction=True)  # autocommit, as a worker's connection: one statement, no savepoint
def test_a_claimer_reads_once_and_writes_a_move_at_most_once_per_interval(django_assert_num_queries: Any) -> None:
    FairCursor.objects.create(queue="fair", fair_after="t03", updated_at="2026-01-01T00:00:00Z")
    cursor = SharedFairCursor("fair", "default", interval=3600)
    with django_assert_num_queries(1):  # the read, once
        assert cursor.current() == "t03"
        assert cursor.current() == "t03"
    with django_assert_num_queries(0):  # a move is made in memory
        cursor.advance("t07")
    with django_assert_num_queries(1):  # the first goes at once
        cursor.sync()
    assert stored() == "t07"
    with django_assert_num_queries(0):  # then nothing per claim until the interval has passed
        for key in ("t08", "t09", "t10"):
            cursor.advance(key)
            cursor.sync()
        cursor.advance(None)  # a claim that found no keys leaves the cursor
        assert cursor.current() == "t10"
    assert stored() == "t07"
    with django_assert_num_queries(1):  # a clean stop writes what moved
        cursor.flush()
    with django_assert_num_queries(0):  # and only that
        cursor.flush()
    assert stored() == "t10"


@pytest.mark.django_db(transaction=True)
def test_a_move_after_the_interval_is_written_by_the_next_claim_or_sync(django_assert_num_queries: Any) -> None:
    cursor = SharedFairCursor("fair", "default", interval=0)
    with django_assert_num_queries(1):
        assert cursor.current() is None  # no row: from the first key
    with django_assert_num_queries(2):
        cursor.advance("t01")
        cursor.sync()
        cursor.advance("t02")
        cursor.sync()
    with django_assert_num_queries(0):  # unchanged: nothing to write
        cursor.advance("t02")
        cursor.sync()
    assert stored() == "t02"


def test_last_writer_wins_and_a_new_claimer_starts_after_it() -> None:
    """Two live claimers write their own positions; a third starting later deals on from the last
    one written (the other's keys it serves again later in its lap: none is skipped)."""
    enqueue_tenants()
    first, second = SharedFairCursor("fair", "default", interval=0), SharedFairCursor("fair", "default", interval=0)
    assert first.current() is None and second.current() is None
    first.advance("t09")
    first.sync()
    second.advance("t04")  # older turns, written last: it wins
    second.sync()
    newcomer = SharedFairCursor("fair", "default")
    claimed = Task.objects.claim("new", limit=3, queues=["fair"], fair_after=newcomer.current())
    assert sorted(c.fair_key or "" for c in claimed) == ["t05", "t06", "t07"]


@pytest.mark.django_db(transaction=True)
def test_a_worker_starts_where_the_shared_cursor_says_and_leaves_its_own_at_its_stop() -> None:
    """A worker's first claim deals on after the stored key, not from the first key; when it stops
    the next one starts after the last key it served."""
    from tasks.worker.process import Worker

    enqueue_tenants()
    FairCursor.objects.create(queue="fair", fair_after="t07", updated_at="2026-01-01T00:00:00Z")
    worker = Worker(
        queues=["fair"], concurrency=4, batch_size=4, max_tasks=4, install_signal_handlers=False, worker_id="life"
    )

    def done() -> list[str]:
        return [
            key or ""
            for key in Task.objects.filter(queue="fair", status="SUCCESSFUL").values_list("fair_key", flat=True)
        ]

    with worker_in_thread(worker):
        wait_until(lambda: len(done()) == 4 and stored() != "t07", 30, what="its one claim's tasks done")
    assert sorted(done()) == ["t08", "t09", "t10", "t11"]
    assert stored() == "t11"


@pytest.mark.django_db(transaction=True)
def test_a_plain_queues_worker_and_api_claims_leave_the_table_alone(client: Any) -> None:
    from tasks.worker.process import Worker

    Task.objects.bulk_enqueue(NOOP, [{}] * 4, queue="plain")
    worker = Worker(queues=["plain"], concurrency=2, batch_size=2, max_tasks=2, install_signal_handlers=False)
    assert worker.dispatcher.fair_cursor is None
    with worker_in_thread(worker):
        wait_until(lambda: Task.objects.filter(queue="plain", status="SUCCESSFUL").count() == 2, 30, what="2 done")
    status, body = Api(client).call("POST", "/api/tasks/next", {"worker": "ext", "queues": ["plain"]})
    assert status == 200 and body["task"] is not None and "fair_after" not in body
    assert Task.objects.filter(queue="plain", started_at__isnull=False).count() == 3
    assert not FairCursor.objects.exists()


def test_a_new_web_process_deals_on_from_the_shared_cursor(client: Any) -> None:
    """The API's claims without a client cursor: a process that never claimed the queue starts where
    the database's claimers left the turns, and writes where its own went."""
    api = Api(client)
    enqueue_tenants(per_key=1)
    FairCursor.objects.create(queue="fair", fair_after="t05", updated_at="2026-01-01T00:00:00Z")
    status, body = api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": ["fair"], "limit": 2})
    assert status == 200, body
    assert [t["fair_key"] for t in body["tasks"]] == ["t06", "t07"] and body["fair_after"] == "t07"
    assert stored() == "t07"
    from tasks.web.api import tasks as api_tasks

    api_tasks._fair_cursors.clear()  # another process (a restart, a replica)
    status, body = api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": ["fair"]})
    assert body["task"]["fair_key"] == "t08"


def test_a_cursor_the_database_refuses_leaves_the_claims_going(caplog: Any) -> None:
    """The table missing (new code before migration 0026 ran) or a refused write: the claimer goes on
    with its own cursor, a warning logged, and the caller's transaction stays usable (a savepoint)."""
    enqueue_tenants(per_key=1)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE tasks_faircursor RENAME TO tasks_faircursor_elsewhere")
    shared = SharedFairCursor("fair", "default", interval=0)
    with caplog.at_level(logging.WARNING, logger="tasks.fair"):
        assert shared.current() is None
        claimed = Task.objects.claim("w", limit=2, queues=["fair"], fair_after=shared.current())
        shared.advance("t01")
        shared.sync()
    assert sorted(c.fair_key or "" for c in claimed) == ["t00", "t01"]
    assert shared.current() == "t01"
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "fair queue fair",
        "fair queue fair",
        "fair queue fair",
    ]
    assert Task.objects.filter(queue="fair", status="RUNNING").count() == 2  # the transaction goes on


@pytest.mark.django_db(transaction=True)
def test_two_first_writers_of_a_queue_never_wait_for_each_other() -> None:
    """The first write of a queue inserts its row. Another session's first write, not committed yet
    (an API claim's, inside its request), must not hold this one up: the insert goes only with the
    queue's advisory lock taken without waiting, and the row found locked is left (breaker 34)."""
    other = psycopg.connect(**connection.get_connection_params())
    try:
        other.execute(sql.FAIR_CURSOR_WRITE_SQL, {"queue": "fresh", "fair_after": "a"})  # its transaction stays open
        with connection.cursor() as cursor:
            cursor.execute("SET statement_timeout = '5s'")  # a wait fails the test instead of hanging it
            try:
                FairCursor.objects.write("fresh", "b")
                assert stored("fresh") is None  # nothing of ours; theirs is not committed
            finally:
                cursor.execute("RESET statement_timeout")
        other.commit()
        assert stored("fresh") == "a"
        other.execute(sql.FAIR_CURSOR_WRITE_SQL, {"queue": "fresh", "fair_after": "c"})  # holds the row now
        FairCursor.objects.write("fresh", "b")  # an update of a locked row: left alone, at once
        other.commit()
        assert stored("fresh") == "c"
        FairCursor.objects.write("fresh", "d")
        assert stored("fresh") == "d"
    finally:
        other.close()


def test_a_stop_handing_back_unstarted_claims_rewinds_to_where_the_earliest_began() -> None:
    """A worker's drain hands back the tasks of its last claims unstarted: its cursor goes back to
    where the earliest of those claims started its turns, so the next life serves those keys
    (breaker 34: a rolling deploy starved the same tenants every life)."""
    cursor = SharedFairCursor("fair", "default", interval=3600)
    cursor.advance("t02", claim=1.0)
    cursor.advance("t05", claim=2.0)
    cursor.advance("t08", claim=3.0)
    cursor.advance("t11", claim=4.0)
    cursor.rewind([])  # nothing handed back: the cursor stays
    assert cursor.current() == "t11"
    cursor.rewind([(4.0, None), (3.0, None)])  # the last two claims' tasks never started
    assert cursor.current() == "t05"
    cursor.advance("t07", claim=5.0)
    cursor.rewind([(4.5, None)])  # a claim not remembered (it found no keys): back to the next one's start
    assert cursor.current() == "t05"
    cursor.advance("t09", claim=6.0)
    cursor.rewind([(0.5, None)])  # older than anything remembered: as far back as is remembered
    assert cursor.current() is None
    cursor.rewind([(6.0, None)])  # nothing remembered any more: the cursor stays
    assert cursor.current() is None


def test_a_drain_handing_back_in_two_steps_rewinds_to_the_earliest_of_both() -> None:
    """A drain hands back what no executor had taken at once, and what an executor gives back later:
    the later step may be of an earlier claim. The first rewind forgot every older claim, so the
    second left the cursor past that claim's keys (a fair test's next life started four keys on,
    on a loaded machine)."""
    cursor = SharedFairCursor("fair", "default", interval=3600)
    cursor.advance("t03", claim=1.0)
    cursor.advance("t07", claim=2.0)  # taken by an executor, given back after the drain began
    cursor.advance("t11", claim=3.0)  # never handed to an executor
    cursor.rewind([(3.0, None)])
    assert cursor.current() == "t07"
    cursor.rewind([(2.0, None)])
    assert cursor.current() == "t03"


def test_a_claim_handed_back_in_part_rewinds_to_the_key_before_its_first_turn_handed_back() -> None:
    """A stop in the middle of a claim: its first turns started, the rest went back unstarted. The
    cursor goes back to the last key before the first turn handed back, not to the claim's start, so
    the turns that started are not dealt again and the next life starts at the first key that lost
    its turn (a fair test's next life started three keys behind the first life's last turn)."""
    cursor = SharedFairCursor("fair", "default", interval=3600)
    cursor.advance("t03", claim=1.0, turns=["t00", "t01", "t02", "t03"])
    cursor.advance("t07", claim=2.0, turns=["t07", "t05", "t06", "t04"])  # any order: dealt in key order
    cursor.advance("t11", claim=3.0, turns=["t08", "t09", "t10", "t11"])
    cursor.rewind([(3.0, "t10"), (3.0, "t11")])
    assert cursor.current() == "t09"
    cursor.rewind([(3.0, "t11")])  # a later return of a later turn of the same claim: never forward
    assert cursor.current() == "t09"
    cursor.rewind([(3.0, "t09")])  # of an earlier turn: further back
    assert cursor.current() == "t08"
    cursor.rewind([(3.0, "t08")])  # its first turn: the claim's start
    assert cursor.current() == "t07"
    cursor.rewind([(2.0, "t06"), (3.0, "t08")])  # the earliest claim decides
    assert cursor.current() == "t05"


def test_a_claim_that_wrapped_rewinds_in_the_order_it_dealt_its_turns() -> None:
    """A claim that started after t08 dealt t09, t10, then wrapped to t00, t01: handing back t00
    goes back to t10, and handing back t10 to t09, whatever the keys' alphabetical order."""
    cursor = SharedFairCursor("fair", "default", interval=3600)
    cursor.advance("t08", claim=1.0, turns=["t07", "t08"])
    cursor.advance("t01", claim=2.0, turns=["t00", "t01", "t09", "t10"])
    cursor.rewind([(2.0, "t00"), (2.0, "t01")])
    assert cursor.current() == "t10"
    cursor.rewind([(2.0, "t10")])
    assert cursor.current() == "t09"


def test_a_turn_the_claim_did_not_deal_rewinds_to_the_claims_start() -> None:
    """A key the claim does not know as one of its turns (or none given): the claim's start, as far
    back as the claim goes, rather than a guess past a turn that may not have started."""
    cursor = SharedFairCursor("fair", "default", interval=3600)
    cursor.advance("t03", claim=1.0, turns=["t00", "t01", "t02", "t03"])
    cursor.advance("t07", claim=2.0, turns=["t04", "t05", "t06", "t07"])
    cursor.rewind([(2.0, "t99")])
    assert cursor.current() == "t03"
