"""The mover's progress marks and the dashboard's rerun, composed with other sessions on real
connections (issue 43; docs/explanation/finished-storage.md, "How far behind" and "Operator
actions"): two movers at once over the same status, a row another session holds, a restore after
the move; Retry / Run again over a selection of hot and moved tasks while the mover holds one of
them mid-batch, with a deduplication key taken meanwhile, with ids that do not exist."""

from __future__ import annotations

import datetime as dt
import threading

import psycopg
import pytest
from django.db import connection

from tasks.maintenance.archive import ARCHIVE_SQL, Archiver
from tasks.maintenance.partitions import create_ahead
from tasks.maintenance.recovery import MaintenanceReport, maintain_once
from tasks.models import ArchiveProgress, Task
from tests.db.test_finished_mover import behind, finished_at, mover_on, now, roll_up_hours, where
from tests.db.test_finished_mover_compositions import batch_params
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True)  # real second connections; DDL of partitions

UTC = dt.timezone.utc


__all__ = ["mover_on"]  # the autouse fixture: the mover on, partitions dropped around each test


def finished_rows(status: str = "SUCCESSFUL") -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM tasks_finished WHERE status = %s", [status])
        return cursor.fetchone()[0]


def blocked_by(pid: int) -> list[str]:
    """The statements of the sessions waiting for ``pid``'s locks."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT query FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", [pid])
        return [row[0] for row in cursor.fetchall()]


def test_two_movers_at_once_over_one_status_move_each_row_once_and_the_mark_counts_every_move() -> None:
    """A cron-mode run (``maintain_once``) while another mover's batch holds its transaction open:
    the run's batch passes the held rows over, moves the others and waits for the held batch only at
    the progress row (a primary-key upsert), then finishes once it commits; no error, no row in both
    tables, the mark the later of the two batches' last finish times (never back), ``moved`` the rows
    both moved. ``moved`` counts moves: a restore (a rerun) takes a row out of tasks_finished and
    leaves it as it was."""
    t0 = now()
    first = finished_at(t0 - dt.timedelta(hours=5))
    later = [finished_at(t0 - dt.timedelta(hours=4, minutes=m)) for m in (30, 20, 10)]
    roll_up_hours()
    # The held statement below is ARCHIVE_SQL alone, which makes no partition: the days of `later`
    # made first (between 04:30 and 05:00 UTC `first` and `later[0]` finished on different days).
    create_ahead(1, now=t0 - dt.timedelta(hours=6))
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as held:
        held.execute("BEGIN")
        # The day partition first (the mover's batch creates it before its statement).
        Archiver(interval=0.0, batch_size=1).run_for(0.0)  # moves `first`, creating its day
        assert where(first).startswith("tasks_finished_")  # type: ignore[union-attr]
        assert [row[1] for row in held.execute(ARCHIVE_SQL, batch_params(t0, 1)).fetchall()] == [later[0]]
        reports: list[MaintenanceReport] = []

        def run_cron() -> None:
            try:
                reports.append(maintain_once(budget=20.0))
            finally:
                connection.close()  # this thread's own

        cron = threading.Thread(target=run_cron)
        cron.start()
        try:
            [waiting] = wait_until(lambda: blocked_by(held.info.backend_pid), timeout=20, what="the run to wait")
            assert "INSERT INTO tasks_archiveprogress" in waiting  # its batch, at the progress row
            assert where(later[0]) == "tasks_task"  # the held batch's move is not committed yet
        finally:
            held.execute("COMMIT")
            cron.join(30)
    [report] = reports
    assert report.errors == [] and report.archived == 2
    for task_id in [first, *later]:
        assert where(task_id).startswith("tasks_finished_successful_")  # type: ignore[union-attr]
    mark = ArchiveProgress.objects.get(status="SUCCESSFUL")
    assert mark.moved == finished_rows() == 4
    assert mark.moved_until >= Task.objects.find(later[-1]).finished_at
    # A rerun's restore takes the row back to tasks_task: `moved` says how many moves there were.
    assert Task.objects.restore([first]) == [first]
    assert where(first) == "tasks_task"
    assert ArchiveProgress.objects.get(status="SUCCESSFUL").moved == 4 and finished_rows() == 3
    # Run again and finished (as long ago as it did, to be taken now): moved again, counted again.
    Task.objects.filter(pk=first).requeue()
    Task.objects.filter(pk=first).update(status="SUCCESSFUL", finished_at=t0 - dt.timedelta(hours=5))
    assert Archiver(interval=0.0).run_for(60.0) == 1
    assert ArchiveProgress.objects.get(status="SUCCESSFUL").moved == 5 and finished_rows() == 4


def test_a_row_another_session_holds_through_a_pass_is_behind_the_mark_until_the_full_pass() -> None:
    """The pass passes the held row over (SKIP LOCKED) and its end notes its limit: the metric says
    0 while that row still waits in tasks_task, for the next full pass (docs: "How far behind")."""
    t0 = now()
    held_id = finished_at(t0 - dt.timedelta(hours=3))
    free = finished_at(t0 - dt.timedelta(hours=2))
    roll_up_hours()
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        other.execute("BEGIN")
        other.execute("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE", [held_id])
        mover = Archiver(interval=0.0)
        assert mover.run_for(60.0) == 1
        other.execute("COMMIT")
    assert where(held_id) == "tasks_task" and where(free).startswith("tasks_finished_")  # type: ignore[union-attr]
    mark = ArchiveProgress.objects.get(status="SUCCESSFUL")
    assert mark.moved_until > Task.objects.get(pk=held_id).finished_at and behind()["SUCCESSFUL"] == 0.0
    assert mover.run_for(60.0) == 0  # a resumed pass starts after the row it moved
    assert where(held_id) == "tasks_task"
    assert Archiver(interval=0.0).run_for(60.0) == 1  # a full pass (a new term's first) takes it
    assert where(held_id).startswith("tasks_finished_")  # type: ignore[union-attr]
