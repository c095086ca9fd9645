"""tasks_finished's day partitions (issue 43): the table mirrors tasks_task column for column, days are
created ahead once, a row lands in its day's partition (and is refused where no day exists), and
retiring detaches and drops whole days past the cutoff, finishing a detach left pending."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from tasks.maintenance.partitions import PartitionError, create_ahead, partitions, retire_before
from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # DETACH PARTITION ... CONCURRENTLY: no transaction

UTC = dt.timezone.utc
DAY = dt.datetime(2020, 1, 1, 12, tzinfo=UTC)


@pytest.fixture(autouse=True)
def no_partitions_left() -> Iterator[None]:
    yield
    with connection.cursor() as cursor:
        cursor.execute("SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = 'tasks_finished'::regclass")
        for (name,) in cursor.fetchall():
            cursor.execute(f'DROP TABLE "{name}"')
        cursor.execute("SELECT relname FROM pg_class WHERE relname LIKE 'tasks\\_finished\\_%%' AND relkind = 'r'")
        for (name,) in cursor.fetchall():  # detached, not dropped (a test that failed half-way)
            cursor.execute(f'DROP TABLE "{name}"')


def columns(table: str) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT attname, format_type(atttypid, atttypmod), attcollation FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            [table],
        )
        return cursor.fetchall()


def finish_into_archive(finished_at: dt.datetime) -> tuple[int, str]:
    """A task finished at ``finished_at``, copied into tasks_finished as the mover will (SELECT *:
    the columns in tasks_task's order); returns its id and the partition it landed in."""
    task_id = Task.objects.enqueue(NOOP).id
    Task.objects.filter(pk=task_id).update(status="SUCCESSFUL", finished_at=finished_at)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_finished SELECT * FROM tasks_task WHERE id = %s RETURNING tableoid::regclass::text",
            [task_id],
        )
        return task_id, cursor.fetchone()[0]


def test_the_finished_table_has_every_column_of_tasks_task_in_its_order() -> None:
    """What the mover's ``INSERT ... SELECT *`` needs: a migration that adds a column to tasks_task must
    add it to tasks_finished too."""
    assert columns("tasks_finished") == columns("tasks_task")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'tasks_finished'::regclass AND contype = 'p'"
        )
        assert cursor.fetchone()[0] == "PRIMARY KEY (id, finished_at)"
        cursor.execute("SELECT pg_get_partkeydef('tasks_finished'::regclass)")
        assert cursor.fetchone()[0] == "RANGE (finished_at)"


def test_days_are_created_ahead_once_and_each_row_lands_in_its_day() -> None:
    assert create_ahead(2, now=DAY) == ["tasks_finished_20200101", "tasks_finished_20200102", "tasks_finished_20200103"]
    assert create_ahead(2, now=DAY + dt.timedelta(days=1)) == ["tasks_finished_20200104"]
    assert create_ahead(1, now=DAY) == []
    listed = partitions()
    assert [p.name for p in listed] == [f"tasks_finished_2020010{d}" for d in range(1, 5)]
    assert listed[0].bounds == "FOR VALUES FROM ('2020-01-01 00:00:00+00') TO ('2020-01-02 00:00:00+00')"
    # UTC days: 23:59:59.999999 on the 1st is the 1st; midnight is the 2nd, wherever the session's zone is.
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'America/New_York'")
        try:
            assert (
                finish_into_archive(dt.datetime(2020, 1, 1, 23, 59, 59, 999999, tzinfo=UTC))[1]
                == "tasks_finished_20200101"
            )
            assert finish_into_archive(dt.datetime(2020, 1, 2, tzinfo=UTC))[1] == "tasks_finished_20200102"
        finally:
            cursor.execute("SET TIME ZONE %s", [connection.timezone_name])
    with pytest.raises(Exception, match="no partition of relation"), transaction.atomic():
        finish_into_archive(dt.datetime(2020, 1, 9, tzinfo=UTC))  # no day made for it: refused, not kept aside
    with pytest.raises(PartitionError):
        create_ahead(-1)


def test_retiring_detaches_and_drops_whole_days_past_the_cutoff_and_nothing_else() -> None:
    create_ahead(3, now=DAY)  # the 1st to the 4th
    with connection.cursor() as cursor:  # a partition someone made by hand: never ours to retire
        cursor.execute(
            "CREATE TABLE tasks_finished_by_hand PARTITION OF tasks_finished"
            " FOR VALUES FROM ('2019-01-01 00:00+00') TO ('2019-01-02 00:00+00')"
        )
    kept, _ = finish_into_archive(dt.datetime(2020, 1, 3, 8, tzinfo=UTC))
    finish_into_archive(dt.datetime(2020, 1, 1, 8, tzinfo=UTC))
    with pytest.raises(PartitionError), transaction.atomic():
        retire_before(dt.datetime(2020, 1, 3, tzinfo=UTC))
    assert retire_before(dt.datetime(2020, 1, 3, tzinfo=UTC)) == ["tasks_finished_20200101", "tasks_finished_20200102"]
    assert [p.name for p in partitions()] == [
        "tasks_finished_20200103",
        "tasks_finished_20200104",
        "tasks_finished_by_hand",
    ]
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM tasks_finished")
        assert cursor.fetchall() == [(kept,)]
        cursor.execute("SELECT to_regclass('tasks_finished_20200101'), to_regclass('tasks_finished_20200102')")
        assert cursor.fetchone() == (None, None)  # dropped, not only detached
    assert retire_before(dt.datetime(2020, 1, 3, tzinfo=UTC)) == []


def test_a_detach_left_pending_is_finished_by_the_next_retirement() -> None:
    """DETACH ... CONCURRENTLY commits the partition as 'detach pending', then waits for every
    transaction that may still see it; cancelled there (its session's statement timeout, an
    operator), it leaves the partition pending: attached for no one, detachable only by FINALIZE."""
    create_ahead(0, now=DAY)
    finish_into_archive(DAY)
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as reader, psycopg.connect(**params, autocommit=True) as detacher:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM tasks_finished").fetchone()  # a snapshot that sees the partition
        pid = detacher.info.backend_pid
        detach = detacher.cursor()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                detach.execute("ALTER TABLE tasks_finished DETACH PARTITION tasks_finished_20200101 CONCURRENTLY")
            except psycopg.Error as exc:
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        with connection.cursor() as cursor:

            def waiting() -> bool:
                cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
                row = cursor.fetchone()
                return row is not None and row[0] == "Lock"

            wait_until(waiting, timeout=20, what="the detach to wait for the reader's snapshot")
            cursor.execute("SELECT pg_cancel_backend(%s)", [pid])
        thread.join(timeout=20)
        assert errors and "cancel" in str(errors[0])
        reader.execute("COMMIT")
    assert [(p.name, p.detach_pending) for p in partitions()] == [("tasks_finished_20200101", True)]
    assert retire_before(DAY + dt.timedelta(days=1)) == ["tasks_finished_20200101"]
    assert partitions() == []


def test_the_command_lists_creates_and_retires(capsys: Any) -> None:
    call_command("tasks_partitions", "list")
    assert "tasks_finished has no partition" in capsys.readouterr().out
    call_command("tasks_partitions", "create", "--days", "1")
    today = dt.datetime.now(UTC).date()
    out = capsys.readouterr().out
    assert f"created tasks_finished_{today:%Y%m%d}" in out
    assert f"tasks_finished_{today + dt.timedelta(days=1):%Y%m%d}: FOR VALUES FROM" in out
    with pytest.raises(CommandError, match="--older-than"):
        call_command("tasks_partitions", "retire")
    call_command("tasks_partitions", "retire", "--older-than", "1d")  # today's and tomorrow's stay
    assert "retired" not in capsys.readouterr().out
    assert len(partitions()) == 2
