"""Retention on the real database: what is pruned, what never is, and fencing tokens afterwards."""

from __future__ import annotations

import datetime as dt
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction

from leasing.exceptions import StaleTokenError
from leasing.fencing import fenced_update
from leasing.models import Lease
from tasks.maintenance.retention import (
    PRUNE_BULK_OPERATIONS_SQL,
    PRUNE_TASKS_SQL,
    PRUNE_WORKERS_SQL,
    AutoPruner,
    PruneCursor,
    count_prunable,
    prune,
    prune_batch,
)
from tasks.models import BulkOperation, Schedule, ScheduleRun, Task, Worker
from tests.helpers.plans import total_rows_read
from tests.helpers.task_paths import NOOP
from tests.testapp.models import FencedRecord

pytestmark = pytest.mark.django_db(transaction=True)

DAY = dt.timedelta(days=1)


def finished(status: str, count: int, *, days_ago: float, queue: str = "default") -> list[int]:
    """``count`` tasks that ended with ``status`` ``days_ago`` days ago."""
    ids = Task.objects.bulk_enqueue(NOOP, ({"i": i} for i in range(count)), queue=queue)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET status = %s, finished_at = clock_timestamp() - make_interval(days => %s)"
            " WHERE id = ANY(%s)",
            [status, days_ago, ids],
        )
    return ids


def test_finished_tasks_older_than_their_status_retention_are_pruned() -> None:
    old_ok = finished("SUCCESSFUL", 30, days_ago=8)
    new_ok = finished("SUCCESSFUL", 5, days_ago=6)
    old_failed = finished("FAILED", 7, days_ago=8)
    old_cancelled = finished("CANCELLED", 3, days_ago=8)
    totals = prune({"SUCCESSFUL": 7 * DAY, "FAILED": 30 * DAY, "CANCELLED": 7 * DAY}, batch_size=7)
    assert totals == {"SUCCESSFUL": 30, "FAILED": 0, "CANCELLED": 3}
    left = set(Task.objects.values_list("pk", flat=True))
    assert left == set(new_ok) | set(old_failed)
    assert not left & set(old_ok + old_cancelled)


def test_unfinished_tasks_are_never_pruned_whatever_their_age() -> None:
    running = Task.objects.enqueue(NOOP).id
    assert [c.id for c in Task.objects.claim("w-1", queues=["default"], limit=1)] == [running]
    ready = Task.objects.enqueue(NOOP).id
    deferred = Task.objects.enqueue(NOOP, run_after=dt.datetime(2100, 1, 1, tzinfo=dt.timezone.utc)).id
    admitted, blocked = (Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=1).id for _ in range(2))
    assert Task.objects.get(pk=blocked).status == "BLOCKED"  # waiting for the key's one slot
    # Even rows that carry an old finish time (set by hand) stay: only finished statuses are pruned.
    Task.objects.all().update(
        enqueued_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc),
        finished_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc),
    )
    totals = prune({"SUCCESSFUL": dt.timedelta(0), "FAILED": dt.timedelta(0), "CANCELLED": dt.timedelta(0)})
    assert totals == {"SUCCESSFUL": 0, "FAILED": 0, "CANCELLED": 0}
    assert set(Task.objects.values_list("pk", flat=True)) == {ready, deferred, running, admitted, blocked}
    assert Task.objects.get(pk=running).status == "RUNNING"
    assert Task.objects.get(pk=blocked).status == "BLOCKED"


def test_a_task_locked_by_another_session_is_passed_over_and_its_requeue_wins() -> None:
    """The pruner never waits for a row lock and never deletes a row whose status changed
    under it: the locking read re-checks the status on the row's newest version."""
    [task_id] = finished("FAILED", 1, days_ago=40)
    other = connections.create_connection("default")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            # An operator's requeue, in flight: the row is locked and about to become READY.
            cursor.execute("UPDATE tasks_task SET status = 'READY', finished_at = NULL WHERE id = %s", [task_id])
            totals = prune({"FAILED": DAY}, batch_size=10)  # does not block on the lock
            assert totals == {"FAILED": 0}
        other.commit()
    finally:
        other.close()
    assert Task.objects.get(pk=task_id).status == "READY"
    assert prune({"FAILED": dt.timedelta(0)}) == {"FAILED": 0}
    assert Task.objects.filter(pk=task_id).exists()


def test_queue_filter_and_batches_resume_from_the_last_key() -> None:
    finished("SUCCESSFUL", 25, days_ago=3, queue="mail")
    kept = finished("SUCCESSFUL", 10, days_ago=3, queue="default")
    cursor = PruneCursor("SUCCESSFUL", DAY)
    sizes = []
    while not cursor.done:
        sizes.append(prune_batch(cursor, limit=10, queue="mail").deleted)
    assert sizes == [10, 10, 5] and cursor.deleted == 25
    assert set(Task.objects.values_list("pk", flat=True)) == set(kept)


def test_the_prune_statement_is_an_index_range_scan() -> None:
    finished("SUCCESSFUL", 50, days_ago=3)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
        cursor.execute("SET LOCAL enable_seqscan = off")
        params = {
            "status": "SUCCESSFUL",
            "queue": None,
            "age": 86400,
            "after_at": dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc),
            "after_id": 0,
            "limit": 10,
        }
        cursor.execute("EXPLAIN " + PRUNE_TASKS_SQL, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    scan = next(line for line in plan.splitlines() if "Index Scan using tasks_task_prune_idx" in line)
    condition = plan.splitlines()[plan.splitlines().index(scan) + 1]
    assert "Index Cond" in condition, plan
    # Both ends of the range are index conditions: the cursor and the cutoff.
    assert "ROW(finished_at, id) >" in condition and "finished_at <" in condition, plan


def test_ended_leases_are_pruned_never_a_live_one_and_tokens_keep_growing() -> None:
    live = Lease.objects.acquire("jobs:live", "h-1", ttl=60)
    ended = Lease.objects.acquire("jobs:sync", "h-1", ttl=60)
    expired = Lease.objects.acquire("jobs:expired", "h-2", ttl=0.001)
    assert live and ended and expired
    assert Lease.objects.release("jobs:sync", "h-1", ended.token)
    # A downstream row fenced by the old grant.
    thing = FencedRecord.objects.create(key="report", value="v1")
    fenced_update(FencedRecord.objects.filter(pk=thing.pk), ended.token, value="by the first grant")

    assert count_prunable("LEASES", dt.timedelta(0)) == 2
    assert prune({"LEASES": dt.timedelta(0)}) == {"LEASES": 2}
    assert set(Lease.objects.values_list("resource", flat=True)) == {"jobs:live"}

    # The resource is recreated from nothing: its token is larger than any before it.
    again = Lease.objects.acquire("jobs:sync", "h-3", ttl=60)
    assert again is not None and again.token > max(live.token, ended.token, expired.token)
    fenced_update(FencedRecord.objects.filter(pk=thing.pk), again.token, value="by the new grant")
    with pytest.raises(StaleTokenError):  # the first grant's late write stays refused
        fenced_update(FencedRecord.objects.filter(pk=thing.pk), ended.token, value="late")
    assert FencedRecord.objects.get(pk=thing.pk).value == "by the new grant"


def test_stopped_workers_are_pruned_unless_they_still_hold_a_running_task() -> None:
    long_ago = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    for worker_id, stopped in (("gone", long_ago), ("holding", long_ago), ("alive", None), ("recent", None)):
        Worker.objects.create(id=worker_id, hostname="h", pid=1, concurrency=1, stopped_at=stopped)
    Worker.objects.filter(id="recent").update(stopped_at=dt.datetime.now(dt.timezone.utc))
    Task.objects.enqueue(NOOP)
    Task.objects.claim("holding", queues=["default"])
    assert prune({"WORKERS": DAY}) == {"WORKERS": 1}
    assert set(Worker.objects.values_list("id", flat=True)) == {"holding", "alive", "recent"}


def test_the_worker_prune_reads_the_running_set_once_not_once_a_candidate() -> None:
    """No index has the running rows by holder (migration 0045): whether a stopped worker still holds
    a running task is read from the running set, once for the statement (a hash anti join on
    PostgreSQL 15 and 18, with the statistics of a quiet hour), not once for each stopped worker it
    looks at."""
    long_ago = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    Worker.objects.bulk_create(
        Worker(id=f"stopped-{n:04}", hostname="h", pid=1, concurrency=1, stopped_at=long_ago) for n in range(1000)
    )
    Task.objects.bulk_enqueue(NOOP, [{}] * 1500, queue="held")
    with connection.cursor() as cursor:  # statistics of a quiet hour: nothing running
        cursor.execute("ANALYZE tasks_task")
        cursor.execute("ANALYZE tasks_worker")
    for n in range(15):  # live workers' running tasks, and one of the stopped workers' (its lease stays)
        holder = "stopped-0500" if n == 0 else f"live-{n}"
        assert len(Task.objects.claim(holder, limit=100, queues=["held"], ttl=3600)) == 100
    params: dict[str, Any] = {
        "age": 86400,
        "after_at": dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc),
        "after_id": "",
        "limit": 20,
    }
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + PRUNE_WORKERS_SQL, params)
        plan = cursor.fetchone()[0][0]["Plan"]
        transaction.set_rollback(True)
    # 1,500 running rows, read once (a loop per stopped worker read 1,000 x 1,500).
    assert total_rows_read(plan) <= 1500, plan
    assert prune({"WORKERS": DAY}) == {"WORKERS": 999}
    assert list(Worker.objects.filter(id__startswith="stopped-").values_list("id", flat=True)) == ["stopped-0500"]


def test_schedule_runs_are_pruned_and_the_schedule_row_stays() -> None:
    now = dt.datetime.now(dt.timezone.utc)
    Schedule.objects.create(name="tick", baseline_at=now, last_slot=now, last_task_id=3)
    for days in (10, 9, 1):
        at = now - dt.timedelta(days=days)
        ScheduleRun.objects.create(schedule="tick", slot=at, task_id=days, token=1, enqueued_at=at)
    assert prune({"SCHEDULE_RUNS": 7 * DAY}) == {"SCHEDULE_RUNS": 2}
    assert list(ScheduleRun.objects.values_list("task_id", flat=True)) == [1]
    assert Schedule.objects.filter(name="tick", last_task_id=3).exists()


def bulk_operation(status: str, *, days_ago: float | None) -> int:
    """A bulk operation in ``status`` that ended ``days_ago`` days ago (None: has not ended)."""
    operation = BulkOperation.objects.create(kind="retry", filter={}, status=status)
    if days_ago is not None:
        BulkOperation.objects.filter(pk=operation.pk).update(
            finished_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days_ago)
        )
    return operation.pk


def test_ended_bulk_operations_are_pruned_never_an_open_one() -> None:
    old = [bulk_operation(status, days_ago=40) for status in ("DONE", "CANCELLED", "FAILED")]
    recent = bulk_operation("DONE", days_ago=2)
    # Open operations, however old their request: a leader is still working them.
    running = bulk_operation("RUNNING", days_ago=None)
    pending = bulk_operation("PENDING", days_ago=None)
    BulkOperation.objects.filter(pk__in=[running, pending]).update(
        created_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=90)
    )
    assert count_prunable("BULK_OPERATIONS", 30 * DAY) == 3
    assert prune({"BULK_OPERATIONS": 30 * DAY}) == {"BULK_OPERATIONS": 3}
    assert set(BulkOperation.objects.values_list("pk", flat=True)) == {recent, running, pending}
    assert not BulkOperation.objects.filter(pk__in=old).exists()


def test_the_bulk_operation_prune_is_an_index_range_scan() -> None:
    for status in ("DONE", "CANCELLED"):
        for _ in range(20):
            bulk_operation(status, days_ago=40)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_bulkoperation")
        cursor.execute("SET LOCAL enable_seqscan = off")
        params: dict[str, Any] = {
            "age": 86400,
            "after_at": dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc),
            "after_id": 0,
        }
        params["limit"] = 10
        cursor.execute("EXPLAIN " + PRUNE_BULK_OPERATIONS_SQL, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    scan = next(line for line in plan.splitlines() if "Index Scan using tasks_bulkop_finished_idx" in line)
    condition = plan.splitlines()[plan.splitlines().index(scan) + 1]
    assert "ROW(finished_at, id) >" in condition and "finished_at <" in condition, plan


def test_auto_pruner_works_a_slice_at_a_time_and_passes_at_its_interval(settings: Any) -> None:
    settings.LEASING_TASKS = {"RETENTION": {"SUCCESSFUL": "1d", "FAILED": None}, "RETENTION_BATCH_SIZE": 10}
    finished("SUCCESSFUL", 45, days_ago=2)
    failed = finished("FAILED", 5, days_ago=400)
    now = [0.0]
    pruner = AutoPruner(interval=60.0, clock=lambda: now[0])
    assert pruner.batch_size == 10
    assert pruner.run_for(0.0) == 10  # a zero budget still does one batch
    assert pruner.run_for(0.0) == 10
    assert pruner.run_for(1000.0) == 25  # the rest of the pass
    assert pruner.run_for(1000.0) == 0  # the next pass is 60 s away
    finished("SUCCESSFUL", 3, days_ago=2)
    assert pruner.run_for(1000.0) == 0
    now[0] = 61.0
    assert pruner.run_for(1000.0) == 3
    assert set(Task.objects.values_list("pk", flat=True)) == set(failed)  # FAILED: kept forever


def test_auto_pruner_does_nothing_when_retention_is_off(settings: Any) -> None:
    settings.LEASING_TASKS = {"RETENTION": None}
    finished("SUCCESSFUL", 3, days_ago=400)
    assert AutoPruner().run_for(10) == 0
    assert Task.objects.count() == 3


def test_prune_tasks_command(settings: Any) -> None:
    finished("SUCCESSFUL", 12, days_ago=3)
    finished("FAILED", 4, days_ago=3)
    Task.objects.enqueue(NOOP)
    out = StringIO()
    call_command("prune_tasks", "--older-than", "2d", "--dry-run", stdout=out)
    assert "successful: would delete 12" in out.getvalue() and "failed: would delete 4" in out.getvalue()
    assert Task.objects.count() == 17

    out = StringIO()
    call_command("prune_tasks", "--older-than", "2d", "--status", "successful", "--batch-size", "5", stdout=out)
    lines = out.getvalue().splitlines()
    assert any("successful: deleted 12" in line and "done" in line for line in lines), lines
    assert lines[-1].startswith("pruned in") and "successful 12" in lines[-1]
    assert Task.objects.count() == 5

    settings.LEASING_TASKS = {"RETENTION": {"FAILED": "1d"}}
    call_command("prune_tasks", stdout=StringIO())  # per status, from RETENTION
    assert sorted(Task.objects.values_list("status", flat=True)) == ["READY"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--status", "READY"], "only finished tasks can be pruned"),
        (["--status", "RUNNING,FAILED"], "only finished tasks can be pruned"),
        (["--older-than", "soon"], "not a duration"),
        (["--include", "everything"], "--include takes"),
    ],
)
def test_prune_tasks_refuses_bad_arguments(args: list[str], message: str) -> None:
    Task.objects.enqueue(NOOP)
    with pytest.raises(CommandError, match=message):
        call_command("prune_tasks", *args)
    assert Task.objects.count() == 1


def test_the_celery_beat_task_runs_one_paced_pass(settings: Any) -> None:
    from tasks.celery import prune_retained

    settings.LEASING_TASKS = {"RETENTION": {"SUCCESSFUL": "1d"}, "RETENTION_BATCH_SIZE": 10}
    finished("SUCCESSFUL", 25, days_ago=2)
    kept = finished("FAILED", 3, days_ago=2)
    assert prune_retained() == {
        "SUCCESSFUL": 25,
        "FAILED": 0,
        "CANCELLED": 0,
        "LEASES": 0,
        "WORKERS": 0,
        "SCHEDULE_RUNS": 0,
        "UNIQUE_KEYS": 0,
        "BULK_OPERATIONS": 0,
    }
    assert set(Task.objects.values_list("pk", flat=True)) == set(kept)
