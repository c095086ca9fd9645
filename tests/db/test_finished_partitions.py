"""tasks_finished's partitions (issue 43): the table mirrors tasks_task column for column, split by
final status and then by UTC day; days are created ahead once (by hand, by the recovery leader, by
the cron-mode maintenance run), a row lands in its status's day (and is refused where no day
exists), and retiring detaches and drops whole days past each status's cutoff, finishing a detach
left pending; the metrics say how far ahead the days reach."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.core.management.base import SystemCheckError
from django.db import OperationalError, connection, transaction

from tasks.maintenance.partitions import (
    KeeperRound,
    PartitionError,
    PartitionKeeper,
    create_ahead,
    partitions,
    retention_cutoffs,
    retire,
    retire_before,
)
from tasks.maintenance.recovery import maintain_once
from tasks.maintenance.retention import retention_policy
from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # DETACH PARTITION ... CONCURRENTLY: no transaction

UTC = dt.timezone.utc
DAY = dt.datetime(2020, 1, 1, 12, tzinfo=UTC)
STATUS_TABLES = ("tasks_finished_successful", "tasks_finished_failed", "tasks_finished_cancelled")


def drop_partitions() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = ANY(%s::regclass[])",
            [list(STATUS_TABLES)],
        )
        for (name,) in cursor.fetchall():
            cursor.execute(f'DROP TABLE "{name}"')
        cursor.execute("SELECT relname FROM pg_class WHERE relname ~ '^tasks_finished_[a-z]+_' AND relkind = 'r'")
        for (name,) in cursor.fetchall():  # detached, not dropped (a test that failed half-way)
            cursor.execute(f'DROP TABLE "{name}"')


@pytest.fixture(autouse=True)
def no_partitions_left() -> Iterator[None]:
    drop_partitions()  # days another test's leader or command made today
    yield
    drop_partitions()


def columns(table: str) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT attname, format_type(atttypid, atttypmod), attcollation FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            [table],
        )
        return cursor.fetchall()


def finish_into_archive(finished_at: dt.datetime, status: str = "SUCCESSFUL") -> tuple[int, str]:
    """A task finished at ``finished_at`` with ``status``, copied into tasks_finished as the mover will
    (SELECT *: the columns in tasks_task's order); returns its id and the partition it landed in."""
    task_id = Task.objects.enqueue(NOOP).id
    Task.objects.filter(pk=task_id).update(status=status, finished_at=finished_at)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_finished SELECT * FROM tasks_task WHERE id = %s RETURNING tableoid::regclass::text",
            [task_id],
        )
        return task_id, cursor.fetchone()[0]


def names() -> list[str]:
    return [p.name for p in partitions()]


def test_the_finished_table_has_every_column_of_tasks_task_and_is_split_by_status_then_day() -> None:
    """What the mover's ``INSERT ... SELECT *`` needs: a migration that adds a column to tasks_task must
    add it to tasks_finished too."""
    assert columns("tasks_finished") == columns("tasks_task")
    for table in STATUS_TABLES:
        assert columns(table) == columns("tasks_task")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'tasks_finished'::regclass AND contype = 'p'"
        )
        assert cursor.fetchone()[0] == "PRIMARY KEY (id, status, finished_at)"
        cursor.execute("SELECT pg_get_partkeydef('tasks_finished'::regclass)")
        assert cursor.fetchone()[0] == "LIST (status)"
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), pg_get_partkeydef(c.oid)"
            " FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'tasks_finished'::regclass ORDER BY 1"
        )
        assert cursor.fetchall() == [
            ("tasks_finished_cancelled", "FOR VALUES IN ('CANCELLED')", "RANGE (finished_at)"),
            ("tasks_finished_failed", "FOR VALUES IN ('FAILED')", "RANGE (finished_at)"),
            ("tasks_finished_successful", "FOR VALUES IN ('SUCCESSFUL')", "RANGE (finished_at)"),
        ]


def test_days_are_created_ahead_once_per_status_and_each_row_lands_in_its_status_and_day() -> None:
    assert create_ahead(1, now=DAY) == [
        "tasks_finished_successful_20200101",
        "tasks_finished_successful_20200102",
        "tasks_finished_failed_20200101",
        "tasks_finished_failed_20200102",
        "tasks_finished_cancelled_20200101",
        "tasks_finished_cancelled_20200102",
    ]
    assert create_ahead(1, now=DAY + dt.timedelta(days=1), statuses=["FAILED"]) == ["tasks_finished_failed_20200103"]
    assert create_ahead(1, now=DAY) == []
    listed = partitions()
    assert [(p.status, p.day.day) for p in listed if p.day] == [
        ("SUCCESSFUL", 1),
        ("SUCCESSFUL", 2),
        ("FAILED", 1),
        ("FAILED", 2),
        ("FAILED", 3),
        ("CANCELLED", 1),
        ("CANCELLED", 2),
    ]
    assert listed[0].bounds == "FOR VALUES FROM ('2020-01-01 00:00:00+00') TO ('2020-01-02 00:00:00+00')"
    # The attached day has the status table's primary key (ATTACH makes it).
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'tasks_finished_failed_20200103'::regclass AND contype = 'p'"
        )
        assert cursor.fetchone()[0] == "PRIMARY KEY (id, status, finished_at)"
    # UTC days: 23:59:59.999999 on the 1st is the 1st; midnight is the 2nd, wherever the session's zone is.
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'America/New_York'")
        try:
            last = dt.datetime(2020, 1, 1, 23, 59, 59, 999999, tzinfo=UTC)
            assert finish_into_archive(last)[1] == "tasks_finished_successful_20200101"
            assert finish_into_archive(last, "FAILED")[1] == "tasks_finished_failed_20200101"
            assert finish_into_archive(dt.datetime(2020, 1, 2, tzinfo=UTC), "CANCELLED")[1] == (
                "tasks_finished_cancelled_20200102"
            )
        finally:
            cursor.execute("SET TIME ZONE %s", [connection.timezone_name])
    with pytest.raises(Exception, match="no partition of relation"), transaction.atomic():
        finish_into_archive(dt.datetime(2020, 1, 3, tzinfo=UTC))  # FAILED has the 3rd, SUCCESSFUL not: refused
    with pytest.raises(Exception, match="no partition of relation"), transaction.atomic():
        finish_into_archive(DAY, "RUNNING")  # not a final status: no partition takes it
    with pytest.raises(PartitionError):
        create_ahead(-1)
    with pytest.raises(PartitionError, match="not a final status: RUNNING"):
        create_ahead(1, statuses=["RUNNING"])


def test_a_day_another_session_attached_meanwhile_is_not_created_twice() -> None:
    """The leader's check lists the days, then creates the missing ones: a command run by hand between
    the two made one of them already (as a table, attached): left alone, not an error."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE tasks_finished_failed_20200101 (LIKE tasks_finished INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
        )
        cursor.execute(
            "ALTER TABLE tasks_finished_failed ATTACH PARTITION tasks_finished_failed_20200101"
            " FOR VALUES FROM ('2020-01-01 00:00+00') TO ('2020-01-02 00:00+00')"
        )
    from tasks.maintenance import partitions as module

    assert module._create("FAILED", DAY.date(), "default") is False
    assert names() == ["tasks_finished_failed_20200101"]


def test_creating_a_day_waits_for_no_reader_of_the_status_table() -> None:
    """ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE: a transaction reading tasks_finished_successful
    (and holding its lock) does not hold the creation up, where CREATE TABLE ... PARTITION OF
    (ACCESS EXCLUSIVE) would wait for it, and every later reader behind it."""
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as reader:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM tasks_finished_successful").fetchone()
        try:
            assert create_ahead(0, now=DAY, statuses=["SUCCESSFUL"]) == ["tasks_finished_successful_20200101"]
            # The form it avoids waits for the reader (here given up after 200 ms).
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '200ms'")
                try:
                    with pytest.raises(OperationalError, match="lock timeout"):
                        cursor.execute(
                            "CREATE TABLE tasks_finished_successful_20200102 PARTITION OF tasks_finished_successful"
                            " FOR VALUES FROM ('2020-01-02 00:00+00') TO ('2020-01-03 00:00+00')"
                        )
                finally:
                    cursor.execute("RESET lock_timeout")
        finally:
            reader.execute("COMMIT")


def test_retiring_detaches_and_drops_whole_days_past_each_status_cutoff_and_nothing_else() -> None:
    create_ahead(3, now=DAY)  # the 1st to the 4th, every status
    with connection.cursor() as cursor:  # a partition someone made by hand: never ours to retire
        cursor.execute(
            "CREATE TABLE tasks_finished_by_hand PARTITION OF tasks_finished_successful"
            " FOR VALUES FROM ('2019-01-01 00:00+00') TO ('2019-01-02 00:00+00')"
        )
    kept, _ = finish_into_archive(dt.datetime(2020, 1, 3, 8, tzinfo=UTC))
    failed, _ = finish_into_archive(dt.datetime(2020, 1, 1, 8, tzinfo=UTC), "FAILED")
    finish_into_archive(dt.datetime(2020, 1, 1, 8, tzinfo=UTC))
    with pytest.raises(PartitionError), transaction.atomic():
        retire_before(dt.datetime(2020, 1, 3, tzinfo=UTC))
    # Successes go up to the 3rd, cancellations up to the 2nd, failures are kept.
    cutoffs = {"SUCCESSFUL": dt.datetime(2020, 1, 3, tzinfo=UTC), "CANCELLED": dt.datetime(2020, 1, 2, 1, tzinfo=UTC)}
    assert retire(cutoffs) == [
        "tasks_finished_successful_20200101",
        "tasks_finished_successful_20200102",
        "tasks_finished_cancelled_20200101",
    ]
    assert names() == [
        "tasks_finished_successful_20200103",
        "tasks_finished_successful_20200104",
        "tasks_finished_by_hand",
        "tasks_finished_failed_20200101",
        "tasks_finished_failed_20200102",
        "tasks_finished_failed_20200103",
        "tasks_finished_failed_20200104",
        "tasks_finished_cancelled_20200102",
        "tasks_finished_cancelled_20200103",
        "tasks_finished_cancelled_20200104",
    ]
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM tasks_finished ORDER BY id")
        assert cursor.fetchall() == [(kept,), (failed,)]
        cursor.execute(
            "SELECT to_regclass('tasks_finished_successful_20200101'),"
            " to_regclass('tasks_finished_successful_20200102')"
        )
        assert cursor.fetchone() == (None, None)  # dropped, not only detached
    assert retire_before(dt.datetime(2020, 1, 2, tzinfo=UTC), statuses=["SUCCESSFUL", "CANCELLED"]) == []


def test_retention_cutoffs_follow_each_status_retention() -> None:
    now = DAY
    policy = retention_policy({"SUCCESSFUL": "7d", "FAILED": None, "CANCELLED": "1d"})
    assert retention_cutoffs(policy, now=now) == {
        "SUCCESSFUL": now - dt.timedelta(days=7),
        "CANCELLED": now - dt.timedelta(days=1),
    }
    assert retention_cutoffs(None, now=now) == {}


def test_a_detach_left_pending_is_finished_by_the_next_retirement() -> None:
    """DETACH ... CONCURRENTLY commits the partition as 'detach pending', then waits for every
    transaction that may still see it; cancelled there (its session's statement timeout, an
    operator), it leaves the partition pending: attached for no one, detachable only by FINALIZE."""
    create_ahead(0, now=DAY, statuses=["SUCCESSFUL"])
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
                detach.execute(
                    "ALTER TABLE tasks_finished_successful"
                    " DETACH PARTITION tasks_finished_successful_20200101 CONCURRENTLY"
                )
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
    assert [(p.name, p.detach_pending) for p in partitions()] == [("tasks_finished_successful_20200101", True)]
    assert retire_before(DAY + dt.timedelta(days=1)) == ["tasks_finished_successful_20200101"]
    assert partitions() == []


def test_a_day_detached_but_not_dropped_is_dropped_by_the_next_retirement() -> None:
    create_ahead(0, now=DAY, statuses=["FAILED"])
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE tasks_finished_failed DETACH PARTITION tasks_finished_failed_20200101")
    assert partitions() == []
    assert retire_before(DAY, statuses=["FAILED"]) == []  # its day had not ended by then
    assert retire_before(DAY + dt.timedelta(days=1), statuses=["FAILED"]) == ["tasks_finished_failed_20200101"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass('tasks_finished_failed_20200101')")
        assert cursor.fetchone() == (None,)


def test_the_keeper_creates_ahead_and_retires_by_retention_when_due(settings: Any) -> None:
    retention = {"SUCCESSFUL": "1d", "CANCELLED": "6d", "FAILED": None}
    settings.LEASING_TASKS = {"FINISHED_DAYS_AHEAD": 2, "RETENTION": retention}
    today = dt.datetime.now(UTC).date()
    old = dt.datetime.now(UTC) - dt.timedelta(days=5)
    create_ahead(0, now=old)  # a day five days back, every status
    keeper = PartitionKeeper(interval=3600)
    done = keeper.run_once()
    assert done is not None
    assert len(done.created) == 9  # today and two ahead, three statuses
    assert done.retired == [f"tasks_finished_successful_{old:%Y%m%d}"]
    assert keeper.run_once() is None  # not due for an hour
    assert f"tasks_finished_failed_{old:%Y%m%d}" in names()  # FAILED kept for ever
    assert f"tasks_finished_cancelled_{old:%Y%m%d}" in names()  # CANCELLED for 6 days
    assert f"tasks_finished_cancelled_{today + dt.timedelta(days=2):%Y%m%d}" in names()
    settings.LEASING_TASKS = {"FINISHED_DAYS_AHEAD": 3, "RETENTION": None}
    done = keeper.run_once(force=True)
    assert done is not None and len(done.created) == 3 and done.retired == []


@pytest.mark.parametrize("ahead", ["3", True, None, 2.5, 0, 367])
def test_a_bad_days_ahead_is_a_logged_upkeep_failure_that_changes_nothing(settings: Any, ahead: Any) -> None:
    """manage.py refuses it (tasks.E122); a process that runs no system checks (a Celery worker's
    cron-mode run, the leader's thread in one) meets it at each check: an upkeep failure the keeper's
    callers log, never an exception that ends the leader's partitions thread or the maintenance run."""
    settings.LEASING_TASKS = {"FINISHED_DAYS_AHEAD": ahead}
    with pytest.raises(PartitionError, match="FINISHED_DAYS_AHEAD"):
        PartitionKeeper().run_once(force=True)
    with pytest.raises(SystemCheckError, match=r"tasks\.E122"):
        call_command("check")
    report = maintain_once(budget=1.0)
    assert report.partitions is None  # logged; the run's other work done
    assert (
        len(report.errors) == 1
        and report.errors[0].startswith("partitions: ")
        and "FINISHED_DAYS_AHEAD" in report.errors[0]
    )
    assert names() == []


def test_a_bad_retention_stops_retirement_with_a_logged_failure_not_an_exception(settings: Any) -> None:
    settings.LEASING_TASKS = {"FINISHED_DAYS_AHEAD": 1, "RETENTION": {"SUCCESSFUL": "a week"}}
    with pytest.raises(PartitionError, match="RETENTION"):
        PartitionKeeper().run_once(force=True)
    assert len(names()) == 6  # days are still created ahead


def test_a_retention_of_zero_retires_yesterday_but_never_the_day_in_use(settings: Any) -> None:
    """A day ends at the next midnight (UTC): a retention of 0s retires it from then on, so the
    keeper never creates today's day and retires it again at each check."""
    settings.LEASING_TASKS = {"FINISHED_DAYS_AHEAD": 1, "RETENTION": {"SUCCESSFUL": "0s", "FAILED": 0}}
    yesterday = dt.datetime.now(UTC) - dt.timedelta(days=1)
    create_ahead(0, now=yesterday)
    keeper = PartitionKeeper()
    first = keeper.run_once(force=True)
    assert first is not None and len(first.created) == 6
    assert sorted(first.retired) == sorted(
        [f"tasks_finished_successful_{yesterday:%Y%m%d}", f"tasks_finished_failed_{yesterday:%Y%m%d}"]
    )
    assert keeper.run_once(force=True) == KeeperRound()  # nothing made, nothing retired
    assert len(names()) == 7  # today and tomorrow per status, and CANCELLED's yesterday (kept 30 days)


def test_the_cron_mode_run_keeps_the_partitions_too(settings: Any) -> None:
    settings.LEASING_TASKS = {"FINISHED_DAYS_AHEAD": 1}
    report = maintain_once(budget=1.0)
    assert report.partitions is not None and len(report.partitions.created) == 6
    assert len(names()) == 6


def test_the_metrics_say_how_far_ahead_the_days_reach(client: Any, settings: Any) -> None:
    from tasks.web.metrics import partition_metrics

    def samples() -> dict[tuple[str, str], float]:
        return {
            (sample.name, sample.labels["status"]): sample.value
            for family in partition_metrics()
            for sample in family.samples
        }

    empty = samples()
    assert empty[("tasks_finished_days_ahead", "SUCCESSFUL")] == float("-inf")
    assert empty[("tasks_finished_partitions", "FAILED")] == 0
    assert empty[("tasks_finished_oldest_day_age_seconds", "FAILED")] == 0
    now = dt.datetime.now(UTC)
    create_ahead(2, now=now, statuses=["SUCCESSFUL"])
    create_ahead(0, now=now - dt.timedelta(days=3), statuses=["SUCCESSFUL"])
    create_ahead(0, now=now - dt.timedelta(days=1), statuses=["FAILED"])  # yesterday's only
    got = samples()
    assert got[("tasks_finished_partitions", "SUCCESSFUL")] == 4
    assert got[("tasks_finished_days_ahead", "SUCCESSFUL")] == 2
    assert got[("tasks_finished_days_ahead", "FAILED")] == -1
    assert got[("tasks_finished_partition_bytes", "SUCCESSFUL")] > 0
    age = got[("tasks_finished_oldest_day_age_seconds", "SUCCESSFUL")]
    assert 3 * 86400 <= age < 4 * 86400
    settings.LEASING_METRICS_PUBLIC = True
    body = client.get("/metrics").content.decode()
    assert 'tasks_finished_days_ahead{database="default",status="SUCCESSFUL"} 2.0' in body


def test_the_command_lists_creates_and_retires(capsys: Any, settings: Any) -> None:
    call_command("tasks_partitions", "list")
    assert "tasks_finished has no day partition" in capsys.readouterr().out
    call_command("tasks_partitions", "create", "--days", "1")
    today = dt.datetime.now(UTC).date()
    out = capsys.readouterr().out
    assert f"created tasks_finished_successful_{today:%Y%m%d}" in out
    assert f"tasks_finished_cancelled_{today + dt.timedelta(days=1):%Y%m%d}: FOR VALUES FROM" in out
    call_command("tasks_partitions", "retire", "--older-than", "1d")  # today's and tomorrow's stay
    assert "retired" not in capsys.readouterr().out
    assert len(partitions()) == 6
    old = dt.datetime.now(UTC) - dt.timedelta(days=10)
    create_ahead(0, now=old)
    settings.LEASING_TASKS = {"RETENTION": {"SUCCESSFUL": "7d", "FAILED": "30d"}}
    call_command("tasks_partitions", "retire", "--status", "successful,FAILED")  # RETENTION's ages, two statuses
    out = capsys.readouterr().out
    assert f"retired tasks_finished_successful_{old:%Y%m%d}" in out
    assert "retired tasks_finished_failed" not in out and "retired tasks_finished_cancelled" not in out
    with pytest.raises(CommandError):
        call_command("tasks_partitions", "create", "--status", "RUNNING")


def test_the_recovery_leader_keeps_the_partitions_and_a_detach_held_up_does_not_hold_its_stop(
    settings: Any,
) -> None:
    """The leader's partitions thread creates the days ahead and retires an old day; a reader's old
    snapshot holds the detach up (DETACH ... CONCURRENTLY waits for it), and stopping the controller
    does not wait for it past PARTITION_JOIN_TIMEOUT. Once the reader ends, the next retirement
    (here the command) finishes what was left."""
    from tasks.maintenance.recovery import RecoveryController

    settings.LEASING_TASKS = {"FINISHED_DAYS_AHEAD": 1, "RETENTION": {"SUCCESSFUL": "1d"}}
    old = dt.datetime.now(UTC) - dt.timedelta(days=5)
    create_ahead(0, now=old, statuses=["SUCCESSFUL"])
    doomed = f"tasks_finished_successful_{old:%Y%m%d}"
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM tasks_finished").fetchone()
        controller = RecoveryController(interval=0.2, history=False)
        thread = threading.Thread(target=controller.run)
        thread.start()
        try:

            def detach_waiting() -> bool:
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE %s AND wait_event_type = 'Lock'",
                        [f'%DETACH PARTITION "{doomed}" CONCURRENTLY%'],
                    )
                    return cursor.fetchone()[0] == 1

            wait_until(detach_waiting, timeout=30, what="the leader's detach to wait for the reader")
            assert len([n for n in names() if n.endswith(f"{dt.datetime.now(UTC):%Y%m%d}")]) == 3  # today's made
        finally:
            controller.stop()
            thread.join(30)
        assert not thread.is_alive()  # stopped while the detach still waits
        assert detach_waiting()
        reader.execute("COMMIT")
    # The stopped term's detach goes on by itself once the reader is gone; a retirement run meanwhile
    # (by hand, or the next leader's) meets it half-way or after, and ends with the day gone either way.
    call_command("tasks_partitions", "retire")

    def dropped() -> bool:
        # Not the listing: the stopped term's detach may have ended, its DROP not yet run.
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regclass(%s)", [doomed])
            return cursor.fetchone() == (None,)

    wait_until(dropped, timeout=30, what="the day retired and dropped")
    assert doomed not in names()


def test_a_day_before_the_year_1000_is_named_with_a_padded_year_used_once_and_retired(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """strftime's %Y does not pad a year before 1000: the 2nd of January of the year 1 was named
    ``..._10102``, which never read back as a day, so the mover made it again at every batch and
    retention never retired it. Its name now pads the year; a partition named the old way is read as
    its day too, used by the mover and retired."""
    from tasks.maintenance import archive

    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "10m", "RETENTION": {"SUCCESSFUL": None, "FAILED": None}}
    day = dt.date(1, 1, 2)
    first = finish_at(dt.datetime(1, 1, 2, 12, tzinfo=UTC))
    assert archive.Archiver(interval=0.0).run_for(60.0) == 1
    assert [(p.name, p.day) for p in partitions()] == [("tasks_finished_successful_00010102", day)]
    made: list[tuple[Any, ...]] = []

    def create_day(*args: Any, **kwargs: Any) -> bool:
        made.append(args)
        return True

    monkeypatch.setattr(archive, "create_day", create_day)
    second = finish_at(dt.datetime(1, 1, 2, 13, tzinfo=UTC))
    assert archive.Archiver(interval=0.0).run_for(60.0) == 1 and made == []  # its day is there
    assert located(first) == located(second) == "tasks_finished_successful_00010102"
    # A day named before the year was padded: read as the same day, not made again.
    with connection.cursor() as cursor:
        cursor.execute(
            'CREATE TABLE "tasks_finished_failed_10105" (LIKE tasks_finished INCLUDING DEFAULTS INCLUDING CONSTRAINTS)'
        )
        cursor.execute(
            'ALTER TABLE tasks_finished_failed ATTACH PARTITION "tasks_finished_failed_10105"'
            " FOR VALUES FROM ('0001-01-05 00:00+00') TO ('0001-01-06 00:00+00')"
        )
    assert create_ahead(0, now=dt.datetime(1, 1, 5, 12, tzinfo=UTC), statuses=["FAILED"]) == []
    failed = finish_at(dt.datetime(1, 1, 5, 12, tzinfo=UTC), "FAILED")
    assert archive.Archiver(interval=0.0).run_for(60.0) == 1 and made == []
    assert located(failed) == "tasks_finished_failed_10105"
    assert retire_before(dt.datetime(1, 1, 6, tzinfo=UTC)) == [
        "tasks_finished_successful_00010102",
        "tasks_finished_failed_10105",
    ]
    assert names() == []


def finish_at(finished_at: dt.datetime, status: str = "SUCCESSFUL") -> int:
    task_id = Task.objects.enqueue(NOOP).id
    Task.objects.filter(pk=task_id).update(status=status, finished_at=finished_at)
    return task_id


def located(task_id: int) -> str | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text FROM tasks_finished WHERE id = %s", [task_id])
        row = cursor.fetchone()
    return None if row is None else row[0]
