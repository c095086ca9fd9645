"""The history rollup (tasks/maintenance/history.py) counting hours again.

- An hour counted again (a second leader, ``recover_tasks`` beside the worker's, a rerun) must give
  the hour as it is then, whole: the module says the statement "recomputes the hour from the tasks and
  overwrites its rows". It overwrites only the keys it still finds: a (queue, task path) whose tasks
  left the hour meanwhile (retried by a bulk operation, deleted by retention) keeps its old row, while
  the hour's mark says the new total: the page's rows and the mark disagree.
- An hour of 100,000 finished tasks counted by two leaders at once (real connections): exact counts,
  never the sum, no deadlock.


Found by breaker 32 (the bug hunt on issue 25's operations: bulk operations, history, tracing, test helpers)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.db.models import F, Sum

from tasks.maintenance.bulk import BulkRunner
from tasks.maintenance.history import COUNT_HOUR_SQL, COUNTED_MARGIN, count_hour
from tasks.models import ActivityHour, ActivityHourMark, BulkOperation, Task
from tests.helpers import test_database_url as database_url  # not collected as a test

pytestmark = pytest.mark.django_db(transaction=True)

# Finished rows of one hour: %(n)s tasks spread over its minutes, 3 task paths x 2 queues; a third
# of them FAILED with 2 failed attempts, the rest SUCCESSFUL; wait 1.5 s, run 0.3 s.
FILL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at,
    last_attempted_at, finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions,
    failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, errors_dropped)
SELECT 'q' || (g %% 2), 0, 'app.jobs.p' || (g %% 3), '[]', '{}',
       CASE WHEN g %% 3 = 0 THEN 'FAILED' ELSE 'SUCCESSFUL' END,
       f - interval '1800 milliseconds', f - interval '1 minute', f - interval '300 milliseconds',
       f - interval '300 milliseconds', f, 1, 3, '[]', '[]', 0, 0,
       CASE WHEN g %% 3 = 0 THEN 2 ELSE 0 END, 0, 0, 0, false, false, 0
FROM generate_series(1, %(n)s) AS g
CROSS JOIN LATERAL (SELECT %(hour)s::timestamptz + (g %% 3600) * interval '1 second' AS f) AS at
"""


def hour_ago(hours: int) -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT date_trunc('hour', statement_timestamp()) - make_interval(hours => %s)", [hours])
        return cursor.fetchone()[0]


def fill(hour: dt.datetime, n: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(FILL, {"hour": hour, "n": n})
        cursor.execute("ANALYZE tasks_task")


def hour_rows(hour: dt.datetime) -> dict[tuple[str, str], tuple[int, int, int]]:
    return {
        (r.queue, r.task_path): (r.succeeded, r.failed, r.cancelled) for r in ActivityHour.objects.filter(hour=hour)
    }


def rows_total(hour: dt.datetime) -> int:
    total = ActivityHour.objects.filter(hour=hour).aggregate(n=Sum(F("succeeded") + F("failed") + F("cancelled")))
    return int(total["n"] or 0)


def test_a_recount_after_a_keys_tasks_left_the_hour_keeps_no_stale_row() -> None:
    hour = hour_ago(3)
    fill(hour, 600)
    assert count_hour(hour) == 600
    assert len(hour_rows(hour)) == 6 and rows_total(hour) == 600
    # The tasks of one task path leave the hour: a bulk retry of its failed ones (finished_at NULL
    # again, they finish later) and retention deleting its successful ones.
    operation = BulkOperation.objects.request("retry", {"task_path": "app.jobs.p0"})
    BulkRunner().run_until_idle()
    operation.refresh_from_db()
    assert operation.changed == 200
    Task.objects.filter(task_path="app.jobs.p1", queue="q1").delete()
    remaining = Task.objects.filter(finished_at__gte=hour, finished_at__lt=hour + dt.timedelta(hours=1)).count()
    # A second leader counts the hour again.
    assert count_hour(hour) == remaining
    mark = ActivityHourMark.objects.get(hour=hour)
    rows = hour_rows(hour)
    assert (mark.tasks, mark.keys) == (remaining, 3)
    # What happens: the rows of app.jobs.p0 (both queues) and of (q1, app.jobs.p1) keep the first
    # count; the hour's rows add up to 600 while its mark says the recount's total.
    assert rows_total(hour) == mark.tasks, (rows_total(hour), mark.tasks, rows)
    assert len(rows) == mark.keys, rows


TASKS = 100_000


def test_an_hour_of_100k_tasks_counted_by_two_leaders_at_once(capsys: Any) -> None:
    hour = hour_ago(2)
    fill(hour, TASKS)
    url = database_url()
    barrier = threading.Barrier(2)
    results: list[Any] = []
    errors: list[BaseException] = []

    def leader() -> None:
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                barrier.wait(30)
                started = time.monotonic()
                row = conn.execute(COUNT_HOUR_SQL, {"hour": hour, "margin": COUNTED_MARGIN}).fetchone()
                assert row is not None
                (found,) = row
                results.append((found, time.monotonic() - started))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=leader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert [found for found, _ in results] == [TASKS, TASKS]
    rows = hour_rows(hour)
    assert len(rows) == 6
    assert rows_total(hour) == TASKS
    failed = sum(f for _, f, _ in rows.values())
    assert failed == len([g for g in range(1, TASKS + 1) if g % 3 == 0])
    attempt_failures = ActivityHour.objects.filter(hour=hour).aggregate(n=Sum("attempt_failures"))["n"]
    assert attempt_failures == 2 * failed
    mark = ActivityHourMark.objects.get(hour=hour)
    assert (mark.tasks, mark.keys) == (TASKS, 6)
    with capsys.disabled():
        print(f"\nhistory: an hour of {TASKS} tasks counted in {', '.join(f'{t:.2f}s' for _, t in results)}")


@pytest.mark.parametrize("status", ["SUCCESSFUL", "CANCELLED", "FAILED"])
def test_a_retention_shorter_than_the_rollups_delay_is_warned_about(settings: Any, status: str) -> None:
    """history.py: "Finished tasks must be kept until their hour is counted" (an hour is counted
    FINAL_AFTER, 5 minutes, after it ends: up to 65 minutes after a task finished). A retention of
    30 minutes prunes them first and the history says those hours had nothing; no check says so."""
    from django.core import checks

    settings.LEASING_TASKS = {"RETENTION": {status: "30m"}}
    found = [message for message in checks.run_checks() if "history" in message.msg.lower()]
    assert found, "no system check warns that the history will miss the tasks retention prunes first"


def test_a_task_retried_then_discarded_without_running_is_not_timed_with_its_old_attempt() -> None:
    """A bulk retry keeps the row's ``last_attempted_at`` (its previous run, two days ago here: it had
    succeeded); a bulk discard then fails it for good before any worker ran it. The rollup times every FAILED row with a
    ``last_attempted_at``: wait = that start - run_after (negative: 0), run = finished_at - that
    start, two days, for a task that did not run in this hour at all."""
    with connection.cursor() as cursor:
        cursor.execute(FILL, {"hour": hour_ago(48), "n": 1})
    (task_id,) = Task.objects.values_list("pk", flat=True)
    BulkOperation.objects.request("retry", {"task_path": "app.jobs.p1", "status": "SUCCESSFUL"})
    BulkRunner().run_until_idle()
    assert Task.objects.get(pk=task_id).status == "READY"
    BulkOperation.objects.request("discard", {"task_path": "app.jobs.p1"})
    BulkRunner().run_until_idle()
    row = Task.objects.get(pk=task_id)
    assert row.status == "FAILED" and row.finished_at >= hour_ago(0)
    count_hour(hour_ago(0))
    (counted,) = ActivityHour.objects.filter(hour=hour_ago(0))
    assert counted.failed == 1
    assert (counted.timed, counted.run_max) == (0, 0), (counted.timed, counted.run_max, counted.run_buckets)
