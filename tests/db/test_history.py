"""The hourly history rollup (tasks/maintenance/history.py): counts, failures and percentiles against a
hand-computed expectation, idempotence under a rerun, a crashed round and two leaders counting the same
hour at once (real connections), the window and its retention, and the leader's round."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from tasks.maintenance import history
from tasks.maintenance.history import BOUNDS, BUCKETS, count_hour, percentile, roll_up_hours
from tasks.maintenance.recovery import RecoveryController
from tasks.models import ActivityHour, ActivityHourMark, Task
from tests.helpers import db_now, wait_until
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers.plans import explained, rows_read, seq_scans_of_tasks

PATH = "tests.testapp.handlers.noop"


def hour_ago(hours: int) -> dt.datetime:
    """The start of the hour ``hours`` before the current one (database clock)."""
    return db_now().replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=hours)


def finished(
    hour: dt.datetime,
    *,
    status: str = "SUCCESSFUL",
    wait: float | None = 1.5,
    run: float | None = 0.3,
    queue: str = "q1",
    path: str = PATH,
    failures: int = 0,
    at_minute: int = 10,
) -> int:
    """One task that finished ``at_minute`` into ``hour`` after waiting ``wait`` and running ``run``
    seconds (None: no attempt started)."""
    (task_id,) = Task.objects.bulk_enqueue(path, [{}], queue=queue)
    end = hour + dt.timedelta(minutes=at_minute)
    started = None if run is None else end - dt.timedelta(seconds=run)
    due = end if started is None or wait is None else started - dt.timedelta(seconds=wait)
    Task.objects.filter(pk=task_id).update(
        status=status,
        run_after=due,
        started_at=started,
        last_attempted_at=started,
        finished_at=end,
        attempts=0 if started is None else 1 + failures,
        failures=failures,
    )
    return task_id


def known_hour(hour: dt.datetime) -> None:
    """The hand-computed hour: in q1, 8 succeeded (run 0.3 s x4, 3 s x3, 30 s), 2 failed for good
    (run 0.03 s and 700 s, 3 failed attempts each), 1 cancelled before it started; waits 1.5 s but
    two of 15 s (the 30 s run and the 0.03 s failure). In q2, one task; one more of q1 finishes in the next hour."""
    for run in (0.3, 0.3, 0.3, 0.3, 3.0, 3.0, 3.0, 30.0):
        finished(hour, run=run, wait=15.0 if run == 30.0 else 1.5)
    finished(hour, status="FAILED", run=0.03, failures=3, wait=15.0)
    finished(hour, status="FAILED", run=700.0, failures=3, at_minute=59)
    finished(hour, status="CANCELLED", run=None, wait=None)
    finished(hour, queue="q2", run=0.004, wait=0.0005)
    finished(hour + dt.timedelta(hours=1), run=0.3)


def buckets(**counts: int) -> list[int]:
    """A bucket array from {"b<index>": count}."""
    values = [0] * BUCKETS
    for name, count in counts.items():
        values[int(name[1:])] = count
    return values


# The buckets, by hand: 0.03 s is in [0.02, 0.05) (index 5), 0.3 s in [0.2, 0.5) (8), 3 s in [2, 5)
# (11), 30 s in [20, 50) (14), 700 s in [500, 1000) (18); waits 1.5 s in [1, 2) (10),
# 15 s in [10, 20) (13). In q2: run 0.004 s in [0.002, 0.005) (2), wait 0.0005 s below 0.001 (0).
RUN_Q1 = buckets(b5=1, b8=4, b11=3, b14=1, b18=1)
WAIT_Q1 = buckets(b10=8, b13=2)


def row(hour: dt.datetime, queue: str = "q1") -> ActivityHour:
    return ActivityHour.objects.get(hour=hour, queue=queue, task_path=PATH)


def assert_known(hour: dt.datetime) -> None:
    q1 = row(hour)
    assert (q1.succeeded, q1.failed, q1.cancelled, q1.attempt_failures, q1.timed) == (8, 2, 1, 6, 10)
    assert q1.run_buckets == RUN_Q1
    assert q1.wait_buckets == WAIT_Q1
    assert q1.run_sum == pytest.approx(0.3 * 4 + 3 * 3 + 30 + 0.03 + 700)
    assert (q1.run_max, q1.wait_max) == (pytest.approx(700.0), pytest.approx(15.0))
    q2 = row(hour, "q2")
    assert (q2.succeeded, q2.timed, q2.run_buckets, q2.wait_buckets) == (1, 1, buckets(b2=1), buckets(b0=1))
    assert ActivityHourMark.objects.get(hour=hour).tasks == 12
    assert ActivityHourMark.objects.get(hour=hour).keys == 2


@pytest.mark.django_db
def test_an_hour_is_counted_as_computed_by_hand() -> None:
    hour = hour_ago(3)
    known_hour(hour)
    assert count_hour(hour) == 12
    assert_known(hour)
    # Percentiles of the run times from the buckets: p50 is rank 5 of 10, the 4th of 4 in [0.2, 0.5)
    # (interpolated: its top); p90 is rank 9, the one in [20, 50); p99 is rank 9.9, 0.9 of the way
    # into [500, 1000) capped by the largest seen (700): 500 + 0.9 x 200.
    assert percentile(RUN_Q1, 0.5, largest=700.0) == pytest.approx(0.5)
    assert percentile(RUN_Q1, 0.9, largest=700.0) == pytest.approx(50.0)
    assert percentile(RUN_Q1, 0.99, largest=700.0) == pytest.approx(680.0)
    # Waits (1.5 s x8, 15 s x2): p50 is rank 5 of the 8 in [1, 2): 1 + 5/8; p95 is rank 9.5, 1.5 of
    # the 2 in [10, 20) capped by 15: 10 + 5 x 0.75.
    assert percentile(WAIT_Q1, 0.5, largest=15.0) == pytest.approx(1 + 5 / 8)
    assert percentile(WAIT_Q1, 0.95, largest=15.0) == pytest.approx(13.75)


def test_percentile_edges() -> None:
    assert percentile([0] * BUCKETS, 0.5, largest=0.0) is None
    # Past the last bound, the largest value seen is the top of the bucket.
    assert percentile(buckets(**{f"b{len(BOUNDS)}": 2}), 1.0, largest=20000.0) == pytest.approx(20000.0)
    assert percentile(buckets(b0=4), 0.5, largest=0.0008) == pytest.approx(0.0004)
    with pytest.raises(ValueError, match="quantile"):
        percentile(buckets(b0=1), 0.0, largest=1.0)
    with pytest.raises(ValueError, match="buckets"):
        percentile([1, 2], 0.5, largest=1.0)


@pytest.mark.django_db
def test_a_rerun_counts_nothing_twice() -> None:
    hour = hour_ago(2)
    known_hour(hour)
    first = roll_up_hours()
    assert hour in first.counted and first.left == 0
    # The round again: the hour is marked, nothing is due.
    assert roll_up_hours().counted == ()
    # Counting the hour again (a second leader, an operator) overwrites it with the same numbers.
    assert count_hour(hour) == 12
    assert_known(hour)


@pytest.mark.django_db
def test_a_round_that_crashes_leaves_nothing_and_its_rerun_counts_the_hour_once() -> None:
    hour = hour_ago(2)
    known_hour(hour)

    class Crash(Exception):
        pass

    def crashing_round() -> None:
        with transaction.atomic():
            count_hour(hour)
            raise Crash  # the connection dies before the commit

    with pytest.raises(Crash):
        crashing_round()
    assert not ActivityHour.objects.filter(hour=hour).exists()
    assert hour in history.due_hours()
    assert hour in roll_up_hours().counted
    assert_known(hour)


@pytest.mark.django_db
def test_the_window_is_counted_newest_first_within_the_budget_and_pruned() -> None:
    ticks = iter(range(1000))
    finished(hour_ago(168))  # a finish in the window's oldest hour: no hour is before every finish
    # A round with a budget of 1.5 ticks of a clock that advances one tick per read: two hours.
    done = roll_up_hours(budget=1.5, clock=lambda: float(next(ticks)))
    assert len(done.counted) == 2
    assert done.counted[0] > done.counted[1]
    assert done.left > 100  # the rest of the 7 days: the next rounds
    assert roll_up_hours().left == 0
    assert ActivityHourMark.objects.count() >= 167
    # Hours past HISTORY_HOURS are deleted by the round.
    old = hour_ago(200)
    ActivityHour.objects.create(hour=old, queue="q1", task_path=PATH, succeeded=1, wait_buckets=[0] * BUCKETS,
                                run_buckets=[0] * BUCKETS)  # fmt: skip
    ActivityHourMark.objects.create(hour=old, counted_at=db_now())
    kept = hour_ago(100)
    ActivityHour.objects.create(hour=kept, queue="q1", task_path=PATH, succeeded=1, wait_buckets=[0] * BUCKETS,
                                run_buckets=[0] * BUCKETS)  # fmt: skip
    assert roll_up_hours().pruned == 1
    assert not ActivityHour.objects.filter(hour=old).exists()
    assert not ActivityHourMark.objects.filter(hour=old).exists()
    assert ActivityHour.objects.filter(hour=kept).exists()


@pytest.mark.django_db
def test_the_hours_before_the_earliest_finish_are_marked_empty_in_one_statement() -> None:
    """A window with tasks finished 5 hours ago and none before: the older due hours are marked with
    no task in one statement (not one count each), an older hour with keys stored from an earlier
    count is counted (its keys deleted), and the hours from the earliest finish on are counted."""
    earliest = hour_ago(5)
    finished(earliest, at_minute=30)
    finished(hour_ago(3))
    stale = hour_ago(40)
    ActivityHour.objects.create(hour=stale, queue="q1", task_path=PATH, succeeded=3, wait_buckets=[0] * BUCKETS,
                                run_buckets=[0] * BUCKETS)  # fmt: skip
    sent: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        done = roll_up_hours()
    assert done.left == 0 and done.tasks == 2
    due = len(done.counted)
    counts = [sql for sql in sent if sql == history.COUNT_HOUR_SQL]
    # Each hour from the earliest finish on (5 hours ago to 1 hour ago, or 2 once FINAL_AFTER is not
    # yet past) and the stale hour, one statement each; every older hour in one.
    assert len(counts) in (5, 6), len(counts)
    assert sent.count(history.MARK_EMPTY_HOURS_SQL) == 1 and due > 160
    marks = ActivityHourMark.objects.filter(hour__lt=earliest)
    assert marks.count() == due - len(counts) + 1  # the stale hour's mark is a count's
    assert set(marks.exclude(hour=stale).values_list("tasks", "keys").distinct()) == {(0, 0)}
    assert not ActivityHour.objects.filter(hour=stale).exists()  # counted: its stale keys gone
    assert ActivityHour.objects.get(hour=earliest).succeeded == 1
    assert roll_up_hours().counted == ()
    # A task found later in a marked hour (a hand edit, a restored dump) is not counted: as for any
    # counted hour, a count begun COUNTED_MARGIN after the mark changes nothing.
    assert history.mark_empty_hours([]) == set()


@pytest.mark.django_db
def test_the_open_hour_is_not_counted(settings: Any) -> None:
    current = hour_ago(0)
    finished(current, at_minute=0)
    roll_up_hours()
    assert not ActivityHourMark.objects.filter(hour=current).exists()
    assert not ActivityHour.objects.filter(hour=current).exists()


@pytest.mark.django_db(transaction=True)
def test_two_leaders_counting_the_same_hour_at_once_write_it_once() -> None:
    """Two real connections run the hour's statement in overlapping transactions: the second waits on
    the first's rows, then overwrites them with the same numbers; nothing is summed."""
    hour = hour_ago(4)
    known_hour(hour)
    url = database_url()
    with psycopg.connect(url) as first, psycopg.connect(url) as second:
        # Its transaction stays open.
        first.execute(history.COUNT_HOUR_SQL, {"hour": hour, "margin": history.COUNTED_MARGIN})
        second_pid = second.info.backend_pid
        errors: list[BaseException] = []

        def run_second() -> None:
            try:
                second.execute(history.COUNT_HOUR_SQL, {"hour": hour, "margin": history.COUNTED_MARGIN})
                second.commit()
            except BaseException as exc:  # reported by the assertion below
                errors.append(exc)

        thread = threading.Thread(target=run_second)
        thread.start()

        def second_waits() -> bool:
            with connection.cursor() as cursor:
                cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [second_pid])
                found = cursor.fetchone()
            return found is not None and found[0] == "Lock"

        wait_until(second_waits, what="the second leader waits for the first's rows")
        first.commit()
        thread.join(30)
        assert not thread.is_alive()
        assert errors == []
    assert_known(hour)
    assert ActivityHour.objects.filter(hour=hour).count() == 2


@pytest.mark.django_db(transaction=True)
def test_the_recovery_leader_rolls_the_hours_up() -> None:
    hour = hour_ago(2)  # over by an hour at least: an hour is counted FINAL_AFTER (5 min) after its end
    known_hour(hour)
    controller = RecoveryController(interval=0.2, prune=False)
    thread = threading.Thread(target=controller.run)
    thread.start()
    try:
        wait_until(lambda: ActivityHourMark.objects.filter(hour=hour).exists(), timeout=30, what="the hour counted")
    finally:
        controller.stop()
        thread.join(30)
    assert_known(hour)


@pytest.mark.django_db
def test_counting_an_hour_reads_its_range_of_the_finished_index() -> None:
    """Over 48 hours of finishes (60,000 tasks), an hour's count reads that hour's index range (about
    1,250 entries), never the table."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,
                last_attempted_at, finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions,
                failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated)
            SELECT 'q' || (g % 3), 0, 'app.jobs.t' || (g % 7), '[]', '{}', 'SUCCESSFUL', at - interval '2 s',
                   at - interval '2 s', at - interval '1 s', at, 1, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false
            FROM generate_series(1, 60000) AS g
            CROSS JOIN LATERAL (SELECT statement_timestamp() - make_interval(secs => g * 2.88) AS at) AS t
            """
        )
        cursor.execute("ANALYZE tasks_task")
    hour = hour_ago(5)
    plan = explained(history.COUNT_HOUR_SQL, {"hour": hour, "margin": history.COUNTED_MARGIN})
    assert seq_scans_of_tasks(plan) == []
    reads = rows_read(plan)
    assert reads and all("tasks_task_prune_idx" in node or "Bitmap Heap" in node for node, _ in reads), reads
    assert max(read for _, read in reads) < 1500
    assert count_hour(hour) == pytest.approx(1250, abs=2)


@pytest.mark.parametrize("hours", [0, -1, 10_000, 2.5, "168", True])
def test_a_bad_history_hours_setting_fails_the_checks(settings: Any, hours: Any) -> None:
    from tasks.checks import check_task_settings

    settings.LEASING_TASKS = {"HISTORY_HOURS": hours}
    assert [error.id for error in check_task_settings()] == ["tasks.E111"]
    settings.LEASING_TASKS = {"HISTORY_HOURS": 24}
    assert check_task_settings() == []
