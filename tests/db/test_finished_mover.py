"""The mover (issue 43; tasks/maintenance/archive.py): with ARCHIVE_AFTER set, finished plain tasks
whose hour the history has counted leave tasks_task for their status's day partition of
tasks_finished, whole and unchanged, in batches that create a missing day first; workflow members,
unfinished tasks, tasks too recent, in an hour not yet counted, or already past their retention stay.
Composed with a session holding a row, an operator's requeue racing a batch, concurrency keys, the
recovery leader and the cron-mode run."""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection

from tasks.maintenance.archive import ARCHIVE_SQL, MOVER_SLICE, NEXT_SQL, Archiver
from tasks.maintenance.history import roll_up_hours as count_hours
from tasks.maintenance.partitions import create_day, partitions
from tasks.maintenance.recovery import RECOVERY_LEASE, RecoveryController, maintain_once
from tasks.models import Task
from tests.db.test_finished_partitions import drop_partitions
from tests.helpers import wait_until
from tests.helpers.plans import seq_scans_of_tasks
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # real second connections; DDL of partitions

UTC = dt.timezone.utc


@pytest.fixture(autouse=True)
def mover_on(settings: Any) -> Iterator[None]:
    drop_partitions()
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "10m"}
    yield
    drop_partitions()


def now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


def finished_at(at: dt.datetime, status: str = "SUCCESSFUL", **enqueue: Any) -> int:
    task_id = Task.objects.enqueue(NOOP, **enqueue).id
    Task.objects.filter(pk=task_id).update(status=status, finished_at=at, return_value=task_id)
    return task_id


def row(table: str, task_id: int) -> dict[str, Any] | None:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT to_jsonb(t) FROM {table} AS t WHERE id = %s", [task_id])
        found = cursor.fetchone()
    if found is None:
        return None
    return json.loads(found[0]) if isinstance(found[0], str) else found[0]


def where(task_id: int) -> str | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tableoid::regclass::text FROM tasks_task WHERE id = %s"
            " UNION ALL SELECT tableoid::regclass::text FROM tasks_finished WHERE id = %s",
            [task_id, task_id],
        )
        found = cursor.fetchall()
    assert len(found) <= 1, found  # never in both
    return found[0][0] if found else None


def roll_up_hours() -> None:
    """Count every past hour, as if COUNTED_MARGIN ago."""
    count_hours()
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_activityhourmark SET counted_at = counted_at - interval '6 minutes'")


def archive() -> int:
    return Archiver(interval=0.0).run_for(60.0)


def test_finished_plain_tasks_move_whole_into_their_status_day_and_the_rest_stays(settings: Any) -> None:
    t0 = now()
    three_hours = t0 - dt.timedelta(hours=3)
    two_days = t0 - dt.timedelta(days=2)
    moved = {
        "ok": finished_at(three_hours),
        "failed": finished_at(three_hours, "FAILED"),
        "cancelled": finished_at(two_days, "CANCELLED"),
        "old": finished_at(two_days),
    }
    stays = {
        "recent": finished_at(t0 - dt.timedelta(minutes=1)),  # newer than ARCHIVE_AFTER
        "ready": Task.objects.enqueue(NOOP).id,
        "past retention": finished_at(t0 - dt.timedelta(days=9)),  # SUCCESSFUL kept 7 days: prune's
    }
    member = Task.objects.enqueue(NOOP, depends_on=[moved["ok"]]).id  # a workflow: members stay
    Task.objects.filter(pk=member).update(status="SUCCESSFUL", finished_at=three_hours)
    parent_before = row("tasks_task", moved["ok"])
    assert parent_before is not None
    roll_up_hours()  # every past hour counted
    before = {name: row("tasks_task", task_id) for name, task_id in moved.items()}
    assert archive() == 3  # "ok" joined the workflow made for its dependant: it stays with it
    assert where(moved["ok"]) == "tasks_task"
    for name in ("failed", "cancelled", "old"):
        task_id = moved[name]
        status = before[name]["status"].lower()  # type: ignore[index]
        day = (three_hours if name == "failed" else two_days).astimezone(UTC)
        assert where(task_id) == f"tasks_finished_{status}_{day:%Y%m%d}", name
        assert row("tasks_finished", task_id) == before[name]  # every column as it was
    for name, task_id in {**stays, "member": member}.items():
        assert where(task_id) == "tasks_task", name
    made = {p.name for p in partitions()}
    assert f"tasks_finished_cancelled_{two_days.astimezone(UTC):%Y%m%d}" in made  # a past day, made for it
    assert archive() == 0  # nothing left to move
    found = Task.objects.find(moved["old"])
    assert found.archived and found.return_value == moved["old"]


def test_an_hour_the_history_has_not_counted_holds_back_every_later_finish() -> None:
    t0 = now()
    early = finished_at(t0 - dt.timedelta(hours=5))
    late = finished_at(t0 - dt.timedelta(hours=2))
    roll_up_hours()
    hole = (t0 - dt.timedelta(hours=3)).replace(minute=0, second=0, microsecond=0)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM tasks_activityhourmark WHERE hour = %s", [hole])
        assert cursor.rowcount == 1
    assert archive() == 1
    assert where(early).startswith("tasks_finished_")  # type: ignore[union-attr]
    assert where(late) == "tasks_task"  # after the uncounted hour: the rollup will read it there
    roll_up_hours()
    assert archive() == 1 and where(late).startswith("tasks_finished_")  # type: ignore[union-attr]


def test_an_hour_counted_moments_ago_holds_its_tasks_back() -> None:
    """A count that began before the hour's mark was written (a deposed leader's, a cron run's)
    would count it again without the tasks moved meanwhile: an hour counted less than
    COUNTED_MARGIN ago is not yet moved from."""
    task_id = finished_at(now() - dt.timedelta(hours=3))
    count_hours()
    assert archive() == 0 and where(task_id) == "tasks_task"
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_activityhourmark SET counted_at = counted_at - interval '6 minutes'")
    assert archive() == 1


def test_off_without_archive_after(settings: Any) -> None:
    task_id = finished_at(now() - dt.timedelta(hours=3))
    roll_up_hours()
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": None}
    assert archive() == 0
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "not a duration"}
    assert archive() == 0
    assert where(task_id) == "tasks_task"


def test_a_row_another_session_holds_is_passed_over_and_moved_by_a_later_pass() -> None:
    t0 = now()
    held, free = finished_at(t0 - dt.timedelta(hours=3)), finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        other.execute("BEGIN")
        other.execute("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE", [held])
        assert archive() == 1  # did not wait for the lock
        assert where(free).startswith("tasks_finished_") and where(held) == "tasks_task"  # type: ignore[union-attr]
        other.execute("COMMIT")
    assert archive() == 1 and where(held).startswith("tasks_finished_")  # type: ignore[union-attr]


def test_a_requeue_racing_a_batch_either_keeps_the_task_live_or_finds_it_gone() -> None:
    """Both orders, with two real connections: a batch that holds the row (its transaction open) makes
    the requeue wait and then find no row (it changes nothing, says so); a requeue that commits first
    makes the batch's lock re-check see a READY row and leave it."""
    t0 = now()
    first, second = finished_at(t0 - dt.timedelta(hours=3)), finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    create_day("SUCCESSFUL", (t0 - dt.timedelta(hours=3)).astimezone(UTC).date())
    params = connection.get_connection_params()
    batch = {
        "status": "SUCCESSFUL",
        "since": t0 - dt.timedelta(days=6),
        "until": t0 - dt.timedelta(minutes=10),
        "after_at": dt.datetime(1, 1, 1, tzinfo=UTC),
        "after_id": 0,
        "limit": 1,
    }
    # 1. The batch first: the requeue waits, then changes nothing.
    with psycopg.connect(**params, autocommit=True) as mover:
        mover.execute("BEGIN")
        assert mover.execute(ARCHIVE_SQL, batch).fetchall()[0][1] == first
        changed: list[int] = []

        def run_requeue() -> None:
            try:
                changed.append(Task.objects.filter(pk=first).requeue())
            finally:
                connection.close()  # this thread's own

        requeue = threading.Thread(target=run_requeue)
        requeue.start()
        with connection.cursor() as cursor:

            def requeue_waits() -> bool:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE%%'"
                )
                return cursor.fetchone()[0] >= 1

            wait_until(requeue_waits, timeout=20, what="the requeue to wait for the batch's lock")
        mover.execute("COMMIT")
        requeue.join(20)
    assert changed == [0] and where(first).startswith("tasks_finished_")  # type: ignore[union-attr]
    # 2. The requeue first (its transaction open): the batch passes the row over; once committed the
    # row is READY and no batch picks it.
    with psycopg.connect(**params, autocommit=True) as operator:
        operator.execute("BEGIN")
        operator.execute("UPDATE tasks_task SET status = 'READY', finished_at = NULL WHERE id = %s", [second])
        assert archive() == 0
        operator.execute("COMMIT")
    assert archive() == 0
    assert Task.objects.get(pk=second).status == "READY"


def test_a_finished_keyed_task_moves_and_its_key_keeps_admitting() -> None:
    t0 = now()
    done = finished_at(t0 - dt.timedelta(hours=3), concurrency_key="k", concurrency_limit=1)
    roll_up_hours()
    assert archive() == 1 and where(done).startswith("tasks_finished_")  # type: ignore[union-attr]
    waiting = Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=1).id
    [claimed] = Task.objects.claim("w1", limit=5)
    assert claimed.id == waiting


def test_the_recovery_leader_and_the_cron_mode_run_move_finished_tasks() -> None:
    t0 = now()
    by_leader = finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    controller = RecoveryController(interval=0.2)
    thread = threading.Thread(target=controller.run)
    thread.start()
    try:
        wait_until(lambda: where(by_leader) != "tasks_task", timeout=30, what="the leader to move the task")
    finally:
        controller.stop()
        thread.join(30)
    by_cron = finished_at(t0 - dt.timedelta(hours=3, minutes=1))
    report = maintain_once(budget=4.0)
    assert report.archived == 1 and where(by_cron).startswith("tasks_finished_")  # type: ignore[union-attr]


def test_the_mover_reads_its_range_of_the_prune_index_only() -> None:
    """Beside 20,000 finished tasks it may not move yet (too recent), a batch's two statements are
    range scans of tasks_task_prune_idx bounded at both ends (the cursor, the limit): their cost is
    the batch, not what tasks_task keeps."""
    t0 = now()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,"
            " finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes,"
            " shared_crashes, unstarted_returns, attempt_started, attempt_isolated)"
            " SELECT 'q', 0, 'app.jobs.x', '[]', '{}', 'SUCCESSFUL', now(), now(), now() - g * interval '1 ms',"
            " 1, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false FROM generate_series(1, 20000) AS g"
        )
        cursor.execute("ANALYZE tasks_task")
    params: dict[str, Any] = {
        "status": "SUCCESSFUL",
        "since": t0 - dt.timedelta(days=7),
        "until": t0 - dt.timedelta(minutes=70),
        "after_at": t0 - dt.timedelta(days=8),
        "after_id": 0,
        "limit": 1000,
    }
    for statement in (NEXT_SQL, ARCHIVE_SQL):
        with connection.cursor() as cursor:
            cursor.execute("BEGIN")
            try:
                cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params)
                plan = cursor.fetchone()[0]
            finally:
                cursor.execute("ROLLBACK")
        assert "tasks_task_prune_idx" in json.dumps(plan), plan
        assert seq_scans_of_tasks(plan[0]["Plan"]) == [], plan
        buffers = plan[0]["Plan"]["Shared Hit Blocks"] + plan[0]["Plan"].get("Shared Read Blocks", 0)
        assert buffers < 50, (statement, buffers)


def test_a_pass_resumes_where_the_last_stopped_and_a_full_pass_takes_what_a_lock_held_back() -> None:
    """Passes resume each status at its last key, so the workflow members kept in tasks_task are not
    stepped over again every pass; a row passed over because another session held it is behind that
    key, and the next full pass (FULL_PASS_INTERVAL, or a new term) moves it."""
    t0 = now()
    held = finished_at(t0 - dt.timedelta(hours=4))
    moved = finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    ticks = [0.0]
    archiver = Archiver(interval=0.0, full_pass_interval=3600.0, clock=lambda: ticks[0])
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        other.execute("BEGIN")
        other.execute("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE", [held])
        assert archiver.run_for(60.0) == 1 and where(moved) != "tasks_task"
        other.execute("COMMIT")
    later = finished_at(t0 - dt.timedelta(hours=2, minutes=30))
    ticks[0] = 60.0
    assert archiver.run_for(60.0) == 1  # resumed after ``moved``: takes ``later``, not ``held``
    assert where(later) != "tasks_task" and where(held) == "tasks_task"
    ticks[0] = 3601.0
    assert archiver.run_for(60.0) == 1  # the full pass
    assert where(held) != "tasks_task"


def test_a_leader_that_leads_again_starts_its_new_term_with_a_full_pass(settings: Any) -> None:
    """A controller whose term ended (its lease lost) and that leads again starts the new term as
    any leader does: with a full pass, which takes a row a lock held back in its last term. Kept
    from the old term, its resumed cursors would step past that row for up to FULL_PASS_INTERVAL."""
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "RETENTION_INTERVAL": 0.2}
    t0 = now()
    held = finished_at(t0 - dt.timedelta(hours=4))
    moved = finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    with leader_beside_a_lock("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE", [held]) as (controller, other):
        wait_until(lambda: where(moved) != "tasks_task", timeout=30, what="the leader to move the free task")
        # A pass that began before the commit below may still be running: let one more end
        # after it, so the cursor surely stands past ``held``.
        passes = controller.archiver.passes
        wait_until(lambda: controller.archiver.passes >= passes + 2, timeout=30, what="a later pass")
        other.execute("COMMIT")
        passes = controller.archiver.passes
        wait_until(lambda: controller.archiver.passes >= passes + 3, timeout=30, what="passes after the commit")
        assert where(held) == "tasks_task"  # behind the resumed cursor: waits for a full pass
        # The term ends (its lease expired under it) and the same controller leads again.
        other.execute(
            "UPDATE leasing_lease SET expires_at = clock_timestamp() - interval '1 second' WHERE resource = %s",
            [RECOVERY_LEASE],
        )
        wait_until(lambda: controller.election.terms >= 2, timeout=30, what="a second term")
        wait_until(lambda: where(held) != "tasks_task", timeout=15, what="the new term's full pass")
    assert where(held).startswith("tasks_finished_")  # type: ignore[union-attr]


@contextmanager
def leader_beside_a_lock(
    lock: str, params: Sequence[Any] = ()
) -> Iterator[tuple[RecoveryController, psycopg.Connection[Any]]]:
    """A recovery leader (no history, no partitions' upkeep) started while another session's
    transaction holds ``lock``; yields both. The other session's transaction is rolled back if the
    caller did not end it, then the leader stops."""
    controller = RecoveryController(interval=0.2, history=False, partitions=False)
    thread = threading.Thread(target=controller.run)
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        other.execute("BEGIN")
        other.execute(lock, params)
        thread.start()
        try:
            yield controller, other
        finally:
            if other.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                other.execute("ROLLBACK")
            controller.stop()
            thread.join(30)
    assert not thread.is_alive()


def test_a_finish_committed_behind_the_cursor_waits_for_the_full_pass_and_is_never_in_both_tables() -> None:
    """A task whose finish commits late, with a finish time already behind a status's resumed cursor
    (its transaction was open while a pass moved later rows), is stepped over by the resumed passes
    and moved by the next full one: never lost, never in both tables. A task requeued and finished
    again gets a new finish time, ahead of the cursor, and moves with the next resumed pass."""
    t0 = now()
    late = Task.objects.enqueue(NOOP).id
    refinished = finished_at(t0 - dt.timedelta(hours=5))
    moved = finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    ticks = [0.0]
    archiver = Archiver(interval=0.0, full_pass_interval=3600.0, clock=lambda: ticks[0])
    # Requeued before any pass (the mover never saw it final), finished again below.
    Task.objects.filter(pk=refinished).update(status="READY", finished_at=None)
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        other.execute("BEGIN")
        other.execute(
            "UPDATE tasks_task SET status = 'SUCCESSFUL', finished_at = %s WHERE id = %s",
            [t0 - dt.timedelta(hours=4), late],
        )
        assert archiver.run_for(60.0) == 1 and where(moved) != "tasks_task"
        other.execute("COMMIT")
    Task.objects.filter(pk=refinished).update(status="SUCCESSFUL", finished_at=t0 - dt.timedelta(hours=2))
    roll_up_hours()
    ticks[0] = 60.0
    assert archiver.run_for(60.0) == 1  # resumed past ``moved``: the refinished task, not ``late``
    assert where(refinished) != "tasks_task" and where(late) == "tasks_task"
    ticks[0] = 120.0
    assert archiver.run_for(60.0) == 0 and where(late) == "tasks_task"
    ticks[0] = 3601.0
    assert archiver.run_for(60.0) == 1  # the full pass
    assert where(late).startswith("tasks_finished_") and row("tasks_task", late) is None  # type: ignore[union-attr]


def test_an_hour_counted_long_enough_ago_stands_when_it_is_counted_again_after_its_tasks_moved() -> None:
    """A count of an hour from a list of due hours read before its mark (a cron run with a long
    budget beside the leader) comes after the mover took the hour's tasks: it changes nothing, where
    it would have overwritten the hour with no tasks."""
    from tasks.maintenance.history import count_hour
    from tasks.models import ActivityHour

    t0 = now()
    task_id = finished_at(t0 - dt.timedelta(hours=3))
    hour = (t0 - dt.timedelta(hours=3)).replace(minute=0, second=0, microsecond=0)
    roll_up_hours()  # counted, the marks aged past COUNTED_MARGIN
    assert archive() == 1 and where(task_id) != "tasks_task"
    assert count_hour(hour) == 0
    assert list(ActivityHour.objects.filter(hour=hour).values_list("succeeded", flat=True)) == [1]
    with connection.cursor() as cursor:  # a fresh count (not aged) is recounted as before
        cursor.execute("UPDATE tasks_activityhourmark SET counted_at = now() WHERE hour = %s", [hour])
    assert count_hour(hour) == 0 and not ActivityHour.objects.filter(hour=hour).exists()


def behind() -> dict[str, float]:
    from tasks.web.metrics import archive_metrics

    return {sample.labels["status"]: sample.value for family in archive_metrics() for sample in family.samples}


def test_the_mover_notes_how_far_it_came_and_the_metric_says_how_far_behind_it_is(client: Any, settings: Any) -> None:
    """Its mark moves with each batch (the last row's finish time), reaches the pass's limit at the
    pass's end and never goes back (a full pass from the oldest day leaves it); the metric is the
    mark's age less max(ARCHIVE_AFTER, 70 min): +Inf before a status's first batch, the backlog's age
    while it catches up, 0 once caught up; absent while ARCHIVE_AFTER is None (the mover off)."""
    from tasks.models import ArchiveProgress

    assert behind() == dict.fromkeys(["SUCCESSFUL", "FAILED", "CANCELLED"], float("inf"))
    t0 = now()
    first = finished_at(t0 - dt.timedelta(hours=5))
    finished_at(t0 - dt.timedelta(hours=4))
    finished_at(t0 - dt.timedelta(hours=4), "FAILED")
    roll_up_hours()
    one_at_a_time = Archiver(interval=0.0, batch_size=1)
    assert one_at_a_time.run_for(0.0) == 1  # one batch: SUCCESSFUL's oldest row
    mark = ArchiveProgress.objects.get(status="SUCCESSFUL")
    assert (mark.moved_until, mark.moved) == (Task.objects.find(first).finished_at, 1)
    lag = behind()
    wait = 70 * 60
    assert 5 * 3600 - wait <= lag["SUCCESSFUL"] < 5 * 3600 - wait + 60  # the backlog's age
    assert lag["FAILED"] == lag["CANCELLED"] == float("inf")  # not reached yet
    assert one_at_a_time.run_for(60.0) == 2  # the rest of the pass
    marks = {m.status: m for m in ArchiveProgress.objects.all()}
    assert {s: m.moved for s, m in marks.items()} == {"SUCCESSFUL": 2, "FAILED": 1, "CANCELLED": 0}
    # Each status's pass reached its limit: ten minutes ago (ARCHIVE_AFTER), or the current hour's
    # start if later (its count does not stand yet); nothing further to move.
    limit = max(t0 - dt.timedelta(minutes=10), t0.replace(minute=0, second=0, microsecond=0))
    for status, mark in marks.items():
        assert limit - dt.timedelta(minutes=61) < mark.moved_until <= now(), status
    assert behind() == dict.fromkeys(["SUCCESSFUL", "FAILED", "CANCELLED"], 0.0)
    # A full pass (a new term) from the oldest day kept: the marks stay where they are.
    kept = {m.status: m.moved_until for m in ArchiveProgress.objects.all()}
    finished_at(t0 - dt.timedelta(hours=6))  # behind the mark (a finish committed late, say)
    full_pass = Archiver(interval=0.0, batch_size=1)
    assert full_pass.run_for(0.0) == 1  # its first batch: that row
    assert {m.status: m.moved_until for m in ArchiveProgress.objects.all()} == kept
    assert full_pass.run_for(60.0) == 0
    assert {m.status: m.moved_until >= kept[m.status] for m in ArchiveProgress.objects.all()} == dict.fromkeys(
        kept, True
    )
    settings.LEASING_METRICS_PUBLIC = True
    body = client.get("/metrics").content.decode()
    assert 'tasks_archive_behind_seconds{database="default",status="FAILED"} 0.0' in body
    out = StringIO()
    call_command("tasks_partitions", "list", stdout=out)
    assert "the mover: SUCCESSFUL moved up to " in out.getvalue() and "(3 rows, noted " in out.getvalue()
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": None}  # the mover off
    assert behind() == {}
    assert "tasks_archive_behind_seconds{" not in client.get("/metrics").content.decode()


def test_the_mover_thread_rests_so_that_it_works_its_share_while_behind_and_waits_for_the_next_pass() -> None:
    """``Archiver.rest``, which paces the leader's mover thread: while a pass is in progress (its
    slice ended first) it rests ``worked * (1 - f) / f`` (f = ARCHIVE_BUSY_FRACTION: half the time at
    0.5, none at 1); once the pass is done, until the next is due, at most MOVER_SLICE."""
    t0 = now()
    for hours in (5, 4, 3):
        finished_at(t0 - dt.timedelta(hours=hours))
    roll_up_hours()
    ticks = [0.0]
    ticking = [True]

    def tick() -> float:  # while ticking, each reading of the clock a second later: one batch a slice
        ticks[0] += ticking[0]
        return ticks[0]

    archiver = Archiver(interval=30.0, batch_size=1, clock=tick)
    assert archiver.run_for(0.5) == 1 and archiver.behind and archiver.passes == 0
    assert archiver.rest(1.0, 0.5) == 1.0
    assert archiver.rest(1.0, 0.25) == 3.0
    assert archiver.rest(2.0, 1.0) == 0.0
    assert archiver.run_for(100.0) == 2 and not archiver.behind and archiver.passes == 1
    ticking[0] = False
    assert archiver.rest(1.0, 0.5) == MOVER_SLICE  # the next pass is 30 s away: check again in a slice
    archiver.interval = 0.5
    ticks[0] += 30.0
    assert archiver.run_for(100.0) == 0  # the next pass, nothing left to move
    assert archiver.passes == 2 and archiver.rest(1.0, 0.5) == 0.5  # the next pass is due in 0.5 s
    ticks[0] += 0.5
    assert archiver.rest(1.0, 0.5) == MOVER_SLICE  # due: nothing began (run_for would have begun it)


def test_the_leaders_mover_neither_waits_for_recovery_nor_holds_it_up(settings: Any) -> None:
    """The mover runs on a thread of its own in the leader's term: while its batch waits (here on a
    lock another session holds on its progress row), recovery rounds go on and a lapsed lease is
    recovered; once the lock goes, the mover moves. In the recovery round, as before, the round
    would wait with it."""
    from tasks.models import ArchiveProgress

    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "RETENTION_INTERVAL": 0.2}
    ArchiveProgress.objects.create(
        status="SUCCESSFUL", moved_until=now() - dt.timedelta(days=1), recorded_at=now(), moved=0
    )
    t0 = now()
    waiting = finished_at(t0 - dt.timedelta(hours=3))
    roll_up_hours()
    progress_row = "SELECT 1 FROM tasks_archiveprogress WHERE status = 'SUCCESSFUL' FOR UPDATE"
    with leader_beside_a_lock(progress_row) as (controller, other):
        wait_until(mover_waits_on_a_lock, timeout=30, what="the mover's batch to wait")
        rounds = controller.rounds
        Task.objects.enqueue(NOOP, queue="lapsing")
        [lapsing] = Task.objects.claim("gone", limit=1, queues=["lapsing"], ttl=0.2)
        wait_until(lambda: Task.objects.get(pk=lapsing.id).status != "RUNNING", timeout=30, what="the lease recovered")
        # (The round that recovers it counts itself once it ends, after the row changed.)
        wait_until(lambda: controller.rounds > rounds, timeout=30, what="the recovery round to end")
        assert where(waiting) == "tasks_task"  # the mover still waits
        other.execute("COMMIT")
        wait_until(lambda: where(waiting) != "tasks_task", timeout=30, what="the mover to move after the lock")


def mover_waits_on_a_lock() -> bool:
    """A session waits for a lock in a statement naming tasks_archiveprogress (read on this test's own
    connection: a transaction's reads of pg_stat_activity are a snapshot taken at its first)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE %s AND pid <> pg_backend_pid()",
            ["%tasks_archiveprogress%"],
        )
        return bool(cursor.fetchone()[0])


@pytest.mark.parametrize(
    ("setting", "value"),
    [("ARCHIVE_AFTER", "soon"), ("ARCHIVE_AFTER", -5)]
    + [("ARCHIVE_BUSY_FRACTION", bad) for bad in (0, -0.5, 1.5, "0.5", True, None)],
)
def test_a_bad_mover_setting_fails_the_checks(settings: Any, setting: str, value: Any) -> None:
    from tasks.checks import check_task_settings

    code = {"ARCHIVE_AFTER": "tasks.E123", "ARCHIVE_BUSY_FRACTION": "tasks.E124"}[setting]
    settings.LEASING_TASKS = {setting: value}
    assert [error.id for error in check_task_settings()] == [code]
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "10m", "ARCHIVE_BUSY_FRACTION": 1}
    assert check_task_settings() == []


def test_an_invalid_mover_setting_met_at_run_time_is_said_once_per_value_until_fixed(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The leader's mover thread reads ARCHIVE_AFTER and ARCHIVE_BUSY_FRACTION every slice (every
    second): a value the checks would refuse, met at run time (settings changed under a running
    process), is logged once, not every second; a second invalid value is logged again; fixed, it
    is forgotten, so the same mistake made later is said again. Meanwhile nothing moves (a bad
    ARCHIVE_AFTER) or the mover works the default share (a bad ARCHIVE_BUSY_FRACTION)."""
    archiver = Archiver(interval=0.0)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "tasks.archive" and r.levelname == "WARNING"]

    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "soon", "ARCHIVE_BUSY_FRACTION": 2}
    for _ in range(3):
        assert archiver.run_for(0.0) == 0
        assert archiver.busy_fraction() == 0.5
    assert len(warnings()) == 2 and "ARCHIVE_BUSY_FRACTION" in warnings()[1]
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "later", "ARCHIVE_BUSY_FRACTION": 0}
    archiver.run_for(0.0), archiver.busy_fraction(), archiver.run_for(0.0), archiver.busy_fraction()
    assert len(warnings()) == 4
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "10m", "ARCHIVE_BUSY_FRACTION": 0.25}
    archiver.run_for(0.0)
    assert archiver.busy_fraction() == 0.25 and len(warnings()) == 4
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "later", "ARCHIVE_BUSY_FRACTION": 0}
    archiver.run_for(0.0), archiver.busy_fraction()
    assert len(warnings()) == 6
