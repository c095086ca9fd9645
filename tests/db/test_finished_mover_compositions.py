"""The mover (tasks/maintenance/archive.py) composed with the enqueues that look at other tasks: a
``depends_on`` naming a plain task (which makes it a workflow's parent: it may then never move) racing
a batch in both orders on two real connections, a dependant naming a task already moved (refused,
saying so), and the keys a moved task held (a dedup key admits a new task; a unique window still
answers with the moved task, which reads by its id)."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from tasks.lifecycle.workflows import WorkflowError
from tasks.maintenance.archive import ARCHIVE_SQL
from tasks.maintenance.partitions import create_day, partitions
from tasks.models import Task
from tests.db.test_finished_mover import archive, finished_at, mover_on, now, roll_up_hours, where
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # real second connections; DDL of partitions

UTC = dt.timezone.utc
__all__ = ["mover_on"]  # the autouse fixture: the mover on, partitions dropped around each test


def batch_params(t0: dt.datetime, limit: int = 10) -> dict[str, Any]:
    """ARCHIVE_SQL's parameters for a batch of successes finished up to ten minutes before ``t0``."""
    return {
        "status": "SUCCESSFUL",
        "since": t0 - dt.timedelta(days=6),
        "until": t0 - dt.timedelta(minutes=10),
        "after_at": dt.datetime(1, 1, 1, tzinfo=UTC),
        "after_id": 0,
        "limit": limit,
    }


def waiting_on_a_lock(query_fragment: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            " AND query LIKE %s",
            ["%" + query_fragment + "%"],
        )
        return cursor.fetchone()[0] >= 1


def test_a_dependant_waiting_on_a_batch_that_moves_its_parent_is_refused_saying_the_parent_moved() -> None:
    """The batch holds the parent (its transaction open): the enqueue's parent lock waits, then finds
    the row gone; the enqueue is refused, naming the move, and leaves nothing behind."""
    t0 = now()
    parent = finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    create_day("SUCCESSFUL", (t0 - dt.timedelta(hours=3)).astimezone(UTC).date())
    tasks_before = Task.objects.count()
    outcome: list[BaseException | int] = []

    def enqueue_dependant() -> None:
        try:
            outcome.append(Task.objects.enqueue(NOOP, depends_on=[parent]).id)
        except BaseException as exc:  # the thread's outcome, asserted below
            outcome.append(exc)
        finally:
            connection.close()  # this thread's own

    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as mover:
        mover.execute("BEGIN")
        assert [r[1] for r in mover.execute(ARCHIVE_SQL, batch_params(t0)).fetchall()] == [parent]
        enqueue = threading.Thread(target=enqueue_dependant)
        enqueue.start()
        wait_until(lambda: waiting_on_a_lock("FOR NO KEY UPDATE"), timeout=20, what="the parent lock")
        mover.execute("COMMIT")
        enqueue.join(20)
    [refused] = outcome
    assert isinstance(refused, WorkflowError), refused
    assert "finished and were moved to tasks_finished" in str(refused) and f"{parent} (SUCCESSFUL)" in str(refused)
    assert "not in database" not in str(refused)
    assert where(parent).startswith("tasks_finished_")  # type: ignore[union-attr]
    assert Task.objects.count() == tasks_before - 1  # no dependant, no half-made workflow member
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM tasks_workflow")
        assert cursor.fetchone()[0] == 0


def test_an_enqueue_that_makes_a_task_a_parent_first_keeps_it_from_every_later_batch() -> None:
    """The enqueue holds the parent (its transaction open): the batch passes it over without waiting;
    once committed, the parent is a workflow member and no pass moves it."""
    t0 = now()
    parent = finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    create_day("SUCCESSFUL", (t0 - dt.timedelta(hours=3)).astimezone(UTC).date())
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as mover, transaction.atomic():
        dependant = Task.objects.enqueue(NOOP, depends_on=[parent]).id
        assert mover.execute(ARCHIVE_SQL, batch_params(t0)).fetchall() == []  # passed over, no wait
    assert archive() == 0
    assert where(parent) == "tasks_task" and Task.objects.get(pk=parent).workflow_id is not None
    assert Task.objects.get(pk=dependant).status == "READY"  # its parent succeeded: runnable


def test_a_dependant_naming_moved_and_unknown_tasks_names_each_for_what_it_is() -> None:
    t0 = now()
    moved = finished_at(t0 - dt.timedelta(hours=3), "FAILED")
    roll_up_hours()
    assert archive() == 1
    with pytest.raises(WorkflowError) as refused:
        Task.objects.enqueue(NOOP, depends_on=[moved, 10**12])
    message = str(refused.value)
    assert f"moved to tasks_finished, where no task can become a parent: {moved} (FAILED)" in message
    assert f"not in database 'default': [{10**12}]" in message


def test_a_dedup_key_whose_holder_moved_admits_a_new_task() -> None:
    t0 = now()
    holder = finished_at(t0 - dt.timedelta(hours=3), dedup_key="report")
    roll_up_hours()
    assert archive() == 1 and where(holder).startswith("tasks_finished_")  # type: ignore[union-attr]
    fresh = Task.objects.enqueue(NOOP, dedup_key="report")
    assert fresh.id != holder and Task.objects.get(pk=fresh.id).status == "READY"
    again = Task.objects.enqueue(NOOP, dedup_key="report")
    assert again.id == fresh.id  # the new holder keeps the key


def test_a_unique_window_whose_task_moved_answers_with_it_and_it_reads_by_id() -> None:
    t0 = now()
    first = Task.objects.enqueue(NOOP, dedup_key="daily", unique_for=dt.timedelta(days=1)).id
    Task.objects.filter(pk=first).update(status="SUCCESSFUL", finished_at=t0 - dt.timedelta(hours=3))
    roll_up_hours()
    assert archive() == 1 and where(first).startswith("tasks_finished_")  # type: ignore[union-attr]
    again = Task.objects.enqueue(NOOP, dedup_key="daily", unique_for=dt.timedelta(days=1))
    assert again.id == first  # the window is still open: the moved task is the answer
    found = Task.objects.find(again.id)
    assert found is not None and found.archived and found.status == "SUCCESSFUL"


def test_two_creators_of_one_day_take_turns_and_neither_fails() -> None:
    """The keeper's thread and the mover's batch (or a cron-mode run) making the same day at once:
    a session holding the status table's lock lets both reach their creation; once it lets go, one
    creates the day and the other finds it made (no duplicate-name error out of either)."""
    day = (now() - dt.timedelta(hours=3)).astimezone(UTC).date()
    outcomes: list[BaseException | bool] = []

    def create() -> None:
        try:
            outcomes.append(create_day("SUCCESSFUL", day))
        except BaseException as exc:  # the thread's outcome, asserted below
            outcomes.append(exc)
        finally:
            connection.close()  # this thread's own

    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as holder:
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE tasks_finished_successful IN SHARE UPDATE EXCLUSIVE MODE")
        creators = [threading.Thread(target=create) for _ in range(2)]
        for creator in creators:
            creator.start()
        with connection.cursor() as cursor:

            def both_wait() -> bool:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database() AND pid <> %s",
                    [holder.info.backend_pid],
                )
                return cursor.fetchone()[0] >= 2

            wait_until(both_wait, timeout=20, what="both creators to wait")
        holder.execute("COMMIT")
        for creator in creators:
            creator.join(20)
    assert sorted(outcomes, key=str) == [False, True], outcomes
    assert f"tasks_finished_successful_{day:%Y%m%d}" in {p.name for p in partitions()}
