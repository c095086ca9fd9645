"""A day partition retired (tasks/maintenance/partitions.py retire: DETACH ... CONCURRENTLY, then
DROP) while the mover's pass, a listing page, the admin's count or a rerun's restore reads or writes
that day (issue 43): no error, nothing lost that retention did not mean to drop."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest
from django.db import connection
from django.test import Client

from tasks.maintenance.archive import Archiver
from tasks.maintenance.partitions import day_start, retire_before
from tasks.models import Task
from tests.db.test_finished_mover import finished_at, mover_on, now, roll_up_hours, where
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)  # real second connections; DDL of partitions

UTC = dt.timezone.utc
__all__ = ["mover_on"]  # the autouse fixture: the mover on, partitions dropped around each test


def test_a_pass_whose_oldest_day_is_retired_under_it_leaves_that_day_to_the_prune() -> None:
    """The partition keeper runs beside the mover: a day that passes its retention while a pass is
    under way is retired, and the pass's next batch of that day finds no partition for its rows. It
    leaves them for the prune and goes on with the next day; no error (the leader's round and a
    cron-mode run's "archive" duty would fail on it)."""
    t0 = now()
    day = (t0 - dt.timedelta(days=2)).astimezone(UTC).date()
    early, late = (finished_at(day_start(day) + dt.timedelta(hours=h)) for h in (1, 2))
    kept = finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    mover = Archiver(interval=0.0, batch_size=1)
    assert mover.run_for(0.0) == 1 and where(early).startswith("tasks_finished_")  # type: ignore[union-attr]
    # The day passes its retention while the pass is under way: retention retires it.
    assert retire_before(day_start(day) + dt.timedelta(days=1), statuses=["SUCCESSFUL"])
    assert where(early) is None  # dropped with its day, as retention meant
    mover.run_for(60.0)
    assert where(late) == "tasks_task"  # left for the prune (its day is past retention)
    assert where(kept).startswith("tasks_finished_")  # type: ignore[union-attr]


def test_pages_counts_and_reruns_go_on_while_a_retirement_waits_for_a_reader_of_its_day(staff: Client) -> None:
    """A reader's transaction that read the day holds the DETACH ... CONCURRENTLY up; meanwhile the
    every-task page, a state page, the admin's changelist (its count) and a rerun of a task of another
    day answer as usual (no 500); a rerun of a task of the day being retired is refused (409: no such
    task, the day out of sight of new statements), nothing restored. Once the reader ends the day is
    dropped, the others kept."""
    t0 = now()
    day = (t0 - dt.timedelta(days=2)).astimezone(UTC).date()
    doomed = [finished_at(day_start(day) + dt.timedelta(hours=h), "FAILED") for h in (1, 2)]
    other_day = finished_at(t0 - dt.timedelta(hours=3), "FAILED")
    roll_up_hours()
    assert Archiver(interval=0.0).run_for(60.0) == 3
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as reader:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM tasks_finished WHERE status = 'FAILED'").fetchone() == (3,)
        retirement = OnItsOwnConnection(
            lambda: retire_before(day_start(day) + dt.timedelta(days=1), statuses=["FAILED"])
        )
        retirement.start()
        retirement.ready.wait(20)
        try:
            wait_until(lambda: waits_for_a_lock(retirement.pid), 20, what="the detach to wait for the reader")
            for url in ("/dashboard/tasks/", "/dashboard/tasks/failed/", "/admin/tasks/task/"):
                assert staff.get(url).status_code == 200, url
            # A day being detached is out of sight of every statement begun since: its task is
            # retention's now, and a rerun of it says there is no such task.
            rerun = staff.post("/dashboard/tasks/action/", {"action": "retry", "ids": [doomed[0]]})
            assert rerun.status_code == 409 and f"no task {doomed[0]}" in rerun.content.decode()
            assert where(doomed[0]) is None
            assert staff.post("/dashboard/tasks/action/", {"action": "retry", "ids": [other_day]}).status_code == 302
        finally:
            reader.execute("COMMIT")
        assert retirement.outcome() == [f"tasks_finished_failed_{day:%Y%m%d}"]
    assert where(doomed[1]) is None  # dropped with its day, as retention meant
    assert where(other_day) == "tasks_task" and Task.objects.get(pk=other_day).status == "READY"
    for url in ("/dashboard/tasks/", "/dashboard/tasks/failed/", "/admin/tasks/task/"):
        assert staff.get(url).status_code == 200, url
