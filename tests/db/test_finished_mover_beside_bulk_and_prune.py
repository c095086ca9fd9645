"""The mover beside the other sessions that change finished rows, on two real connections, each
committing in either order: a bulk operation's batch (tasks/lifecycle/bulk.py) and retention's prune
(tasks/maintenance/retention.py) at the retention edge (the oldest day kept, rows older than its
cutoff, which both may take). Each row ends in one place (moved, changed where it is, or deleted),
never in both tables, never changed twice; the bulk operation counts as changed only the rows it
changed, and nobody raises."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import psycopg
import pytest
from django.db import connection

from tasks.conf import get_settings
from tasks.lifecycle.bulk import BULK_RETRY_SQL, filter_params
from tasks.maintenance.archive import ARCHIVE_SQL
from tasks.maintenance.bulk import BulkRunner
from tasks.maintenance.partitions import create_day, day_start
from tasks.maintenance.retention import PRUNE_TASKS_SQL, PruneCursor, prune_batch
from tasks.models import BulkOperation, Task
from tests.db.test_finished_mover import archive, finished_at, mover_on, now, roll_up_hours, where
from tests.db.test_finished_mover_compositions import waiting_on_a_lock
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True)  # real second connections; DDL of partitions

__all__ = ["mover_on"]  # the autouse fixture: the mover on, partitions dropped around each test

UTC = dt.timezone.utc
EPOCH = dt.datetime(1, 1, 1, tzinfo=UTC)


def second_connection() -> psycopg.Connection[Any]:
    # The connection's own parameters (Django's: a client-side binding cursor, as its statements expect).
    return psycopg.connect(**connection.get_connection_params(), autocommit=True)


def batch(t0: dt.datetime, status: str = "FAILED", limit: int = 2) -> dict[str, Any]:
    return {
        "status": status,
        "since": t0 - dt.timedelta(days=6),
        "until": t0 - dt.timedelta(minutes=10),
        "after_at": EPOCH,
        "after_id": 0,
        "limit": limit,
    }


def test_a_bulk_retry_waiting_on_a_batch_that_moves_its_rows_retries_them_from_where_they_went() -> None:
    """The batch holds two of the failed rows (deleted, not committed): the bulk batch's update waits
    on them and finds them gone when the batch commits; in its transaction it then finds them in
    tasks_finished (RETRY_MISSED_SQL), brings them back and retries them with the rest, counted
    changed. (Until the mover ran on a thread of its own beside the leader's bulk operations they
    were counted skipped and stayed FAILED: an operator's "retry all" left them out.)"""
    t0 = now()
    three_hours = t0 - dt.timedelta(hours=3)
    old = [finished_at(three_hours + dt.timedelta(seconds=i), "FAILED") for i in range(3)]
    recent = finished_at(t0 - dt.timedelta(minutes=1), "FAILED")
    roll_up_hours()
    create_day("FAILED", three_hours.astimezone(UTC).date())
    operation = BulkOperation.objects.request("retry", {})
    outcome: list[BaseException | Any] = []

    def run_bulk() -> None:
        try:
            outcome.append(BulkRunner(batch_size=100, span=1000).run_batch())
        except BaseException as exc:  # the thread's outcome, asserted below
            outcome.append(exc)
        finally:
            connection.close()  # this thread's own

    with second_connection() as mover:
        mover.execute("BEGIN")
        assert [r[1] for r in mover.execute(ARCHIVE_SQL, batch(t0)).fetchall()] == old[:2]
        bulk = threading.Thread(target=run_bulk)
        bulk.start()
        wait_until(lambda: waiting_on_a_lock("tasks_bulkoperation"), timeout=20, what="the bulk batch's row lock")
        mover.execute("COMMIT")
        bulk.join(20)
    [result] = outcome
    assert not isinstance(result, BaseException), result
    assert (result.batch_picked, result.batch_changed) == (4, 4)
    assert (result.matched, result.changed, result.skipped) == (4, 4, 0)
    operation.refresh_from_db()
    assert (operation.status, operation.matched, operation.changed, operation.skipped) == ("DONE", 4, 4, 0)
    for task_id in old:
        assert where(task_id) == "tasks_task"
    assert set(Task.objects.filter(pk__in=[*old, recent]).values_list("status", flat=True)) == {"READY"}
    assert {Task.objects.get(pk=task_id).attempts for task_id in old} == {0}  # retried once each
    with connection.cursor() as cursor:  # nothing left behind in tasks_finished
        cursor.execute("SELECT count(*) FROM tasks_finished")
        assert cursor.fetchone()[0] == 0


def test_a_batch_beside_an_open_bulk_retry_passes_over_its_rows_and_they_stay_retried() -> None:
    """The bulk batch holds the rows it retried (not committed): the mover passes over them without
    waiting and moves the others; the retried rows stay in tasks_task, READY, once the bulk commits."""
    t0 = now()
    three_hours = t0 - dt.timedelta(hours=3)
    retried = [finished_at(three_hours + dt.timedelta(seconds=i), "FAILED", queue="again") for i in range(3)]
    others = [finished_at(three_hours + dt.timedelta(seconds=10 + i), "FAILED") for i in range(2)]
    roll_up_hours()
    operation = BulkOperation.objects.request("retry", {"queue": "again"})
    params = {
        "operation": operation.pk,
        "batch": 100,
        "span": 1000,
        "fair_queues": list(get_settings().FAIR_QUEUES),
        **filter_params(operation.filter),
    }
    with second_connection() as bulk:
        bulk.execute("BEGIN")
        [row] = bulk.execute(BULK_RETRY_SQL, params).fetchall()
        assert row[0] == "DONE" and row[5:] == (3, 3, None, None)  # none brought back, none missed
        assert archive() == 2  # the others; the held rows passed over, not waited for
        bulk.execute("COMMIT")
    assert archive() == 0  # retried: READY, not finished any more
    assert set(Task.objects.filter(pk__in=retried).values_list("status", flat=True)) == {"READY"}
    for task_id in retried:
        assert where(task_id) == "tasks_task"
    for task_id in others:
        assert where(task_id).startswith("tasks_finished_failed_")  # type: ignore[union-attr]
    operation.refresh_from_db()
    assert (operation.matched, operation.changed, operation.skipped) == (3, 3, 0)


def edge_rows(t0: dt.datetime, count: int) -> tuple[list[int], dt.timedelta]:
    """``count`` successful tasks on the oldest day SUCCESSFUL's retention keeps, older than its
    cutoff: past retention (prune's) and in a day the mover plans (its pass starts at the day)."""
    age = dt.timedelta(days=7)  # SUCCESSFUL's default retention
    cutoff = t0 - age
    start = day_start(cutoff.astimezone(UTC).date())
    ids = [finished_at(start + dt.timedelta(milliseconds=i)) for i in range(count)]
    if start + dt.timedelta(milliseconds=count) >= cutoff:
        pytest.skip("the cutoff is within the first milliseconds of a UTC day")
    return ids, age


@pytest.mark.parametrize("held_by", ["mover", "prune"])
def test_a_row_past_retention_on_the_oldest_day_kept_ends_moved_or_deleted_never_both(held_by: str) -> None:
    t0 = now()
    ids, age = edge_rows(t0, 4)
    roll_up_hours()
    day = day_start((t0 - age).astimezone(UTC).date())
    create_day("SUCCESSFUL", day.date())
    with second_connection() as other:
        other.execute("BEGIN")
        if held_by == "mover":
            params = {**batch(t0, "SUCCESSFUL"), "since": day}
            held = [r[1] for r in other.execute(ARCHIVE_SQL, params).fetchall()]
            # The prune passes over the rows the open batch holds and deletes the rest.
            cursor = PruneCursor("SUCCESSFUL", age)
            deleted = prune_batch(cursor, limit=100).deleted
            assert deleted == 2
        else:
            params = {
                "status": "SUCCESSFUL",
                "queue": None,
                "age": age.total_seconds(),
                "after_at": EPOCH,
                "after_id": 0,
                "limit": 2,
            }
            held = [r[1] for r in other.execute(PRUNE_TASKS_SQL, params).fetchall()]
            assert archive() == 2  # the mover passes over the rows the open prune holds
        assert held == ids[:2]
        other.execute("COMMIT")
    assert archive() == 0
    assert prune_batch(PruneCursor("SUCCESSFUL", age), limit=100).deleted == 0
    places = {task_id: where(task_id) for task_id in ids}  # where() asserts never in both
    moved = [i for i, place in places.items() if place is not None]
    gone = [i for i, place in places.items() if place is None]
    assert all(place is None or place.startswith("tasks_finished_successful_") for place in places.values())
    assert (moved, gone) == ((ids[:2], ids[2:]) if held_by == "mover" else (ids[2:], ids[:2]))
