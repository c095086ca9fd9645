"""Bulk operations on the real database: what each kind changes and leaves, the cursor, cancel,
dedup collisions, a second connection's concurrent moves, and refused filters."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections

from tasks.lifecycle.bulk import BULK_RETRY_SQL, BulkFilterError, parse_filter
from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Task
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def make(status: str, count: int, *, queue: str = "default", kwargs: dict | None = None, **extra: object) -> list[int]:
    ids = Task.objects.bulk_enqueue(NOOP, ({**(kwargs or {}), "i": i} for i in range(count)), queue=queue)
    if status in ("FAILED", "CANCELLED", "SUCCESSFUL"):
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE tasks_task SET status = %s, failures = %s, finished_at = clock_timestamp() WHERE id = ANY(%s)",
                [status, 3 if status == "FAILED" else 0, ids],
            )
    if extra:
        Task.objects.filter(pk__in=ids).update(**extra)
    return ids


def statuses(ids: list[int]) -> dict[str, int]:
    found: dict[str, int] = {}
    for status in Task.objects.filter(pk__in=ids).values_list("status", flat=True):
        found[status] = found.get(status, 0) + 1
    return found


def test_retry_requeues_every_matching_failed_task_once_in_small_batches() -> None:
    failed = make("FAILED", 57)
    other_queue = make("FAILED", 5, queue="other")
    ok = make("SUCCESSFUL", 4)
    operation = BulkOperation.objects.request("retry", {"queue": "default"}, requested_by="ops")
    assert operation.status == "PENDING"
    runner = BulkRunner(batch_size=10, span=25)
    assert runner.run_until_idle() == 57
    operation.refresh_from_db()
    assert (operation.status, operation.matched, operation.changed, operation.skipped) == ("DONE", 57, 57, 0)
    assert operation.batches >= 6 and operation.finished_at is not None and operation.progress == 1.0
    assert statuses(failed) == {"READY": 57}
    assert set(Task.objects.filter(pk__in=failed).values_list("failures", "attempts")) == {(0, 0)}
    assert statuses(other_queue) == {"FAILED": 5}
    assert statuses(ok) == {"SUCCESSFUL": 4}  # a retry re-runs SUCCESSFUL tasks only when named


def test_each_row_is_changed_at_most_once_per_operation() -> None:
    failed = make("FAILED", 30)
    BulkOperation.objects.request("retry", {})
    runner = BulkRunner(batch_size=7, span=10)
    runner.run_batch()
    runner.run_batch()
    # The retried rows fail again behind the cursor: the operation does not come back to them.
    Task.objects.filter(pk__in=failed[:14]).update(status="FAILED")
    runner.run_until_idle()
    operation = BulkOperation.objects.get()
    assert operation.changed == 30 and operation.matched == 30
    assert statuses(failed[:14]) == {"FAILED": 14}
    assert statuses(failed[14:]) == {"READY": 16}


def test_cancel_and_discard_never_touch_running_tasks() -> None:
    waiting = make("READY", 6, queue="q")
    claimed = [c.id for c in Task.objects.claim("w-1", queues=["q"], limit=2)]
    assert len(claimed) == 2
    BulkOperation.objects.request("cancel", {"queue": "q"})
    BulkRunner().run_until_idle()
    assert statuses(claimed) == {"RUNNING": 2}
    assert statuses([i for i in waiting if i not in claimed]) == {"CANCELLED": 4}

    more = make("READY", 3, queue="d")
    BulkOperation.objects.request("discard", {"queue": "d"})
    BulkRunner().run_until_idle()
    assert statuses(more) == {"FAILED": 3}
    entry = Task.objects.get(pk=more[0]).errors[-1]
    assert entry["type"] == "tasks.Discarded" and entry["kind"] == "discard"
    with pytest.raises(BulkFilterError, match="RUNNING task is never taken"):
        parse_filter("cancel", {"status": ["RUNNING"]})


def test_filters_narrow_the_operation() -> None:
    customer = make("FAILED", 4, kwargs={"customer": 7})
    others = make("FAILED", 4, kwargs={"customer": 8})
    BulkOperation.objects.request("retry", {"kwargs_contains": {"customer": 7}, "status": "FAILED"})
    BulkRunner().run_until_idle()
    assert statuses(customer) == {"READY": 4} and statuses(others) == {"FAILED": 4}

    by_key = make("CANCELLED", 2, dedup_key=None)
    Task.objects.filter(pk=by_key[0]).update(dedup_key="k-1")
    BulkOperation.objects.request("retry", {"dedup_key": "k-1"})
    BulkRunner().run_until_idle()
    assert statuses(by_key[:1]) == {"READY": 1} and statuses(by_key[1:]) == {"CANCELLED": 1}

    old = make("FAILED", 3)
    BulkOperation.objects.request("retry", {"finished_before": "2000-01-01T00:00:00+00:00"})
    BulkRunner().run_until_idle()
    assert statuses(old) == {"FAILED": 3}


def test_a_dedup_collision_skips_that_row_and_retries_the_rest() -> None:
    rows = make("FAILED", 5)
    Task.objects.filter(pk__in=rows[:2]).update(dedup_key="same")  # two finished rows with one key
    live = Task.objects.enqueue(NOOP, dedup_key="live").id
    Task.objects.filter(pk=rows[2]).update(dedup_key="live")  # and one whose key an unfinished task holds
    BulkOperation.objects.request("retry", {"status": ["FAILED"]})
    BulkRunner(batch_size=100).run_until_idle()
    operation = BulkOperation.objects.get()
    assert (operation.matched, operation.changed, operation.skipped) == (5, 3, 2)
    assert statuses(rows[:2]) == {"READY": 1, "FAILED": 1}
    assert statuses(rows[2:3]) == {"FAILED": 1} and statuses([live]) == {"READY": 1}
    assert statuses(rows[3:]) == {"READY": 2}


def test_a_cancelled_operation_runs_no_further_batch() -> None:
    rows = make("FAILED", 40)
    operation = BulkOperation.objects.request("retry", {})
    runner = BulkRunner(batch_size=10, span=10)
    runner.run_batch()
    assert BulkOperation.objects.filter(pk=operation.pk).cancel() == 1
    assert runner.run_until_idle() == 0
    operation.refresh_from_db()
    assert operation.status == "CANCELLED" and operation.changed == 10
    assert statuses(rows) == {"READY": 10, "FAILED": 30}
    assert BulkOperation.objects.filter(pk=operation.pk).cancel() == 0


def test_a_row_that_moves_while_its_batch_waits_is_skipped_not_changed() -> None:
    rows = make("FAILED", 3)
    operation = BulkOperation.objects.request("retry", {})
    other = connections.create_connection("default")
    try:
        # Another session changes a matching row and holds its lock: the batch picks it from its
        # snapshot, waits for the lock, then re-checks the guard on the newest version.
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute("UPDATE tasks_task SET status = 'READY', finished_at = NULL WHERE id = %s", [rows[1]])
        done = threading.Event()

        def run() -> None:
            try:
                BulkRunner().run_until_idle()
            finally:
                connections.close_all()
                done.set()

        thread = threading.Thread(target=run)
        thread.start()
        assert not done.wait(0.5)  # the batch waits for the row lock
        other.commit()
        assert done.wait(30)
        thread.join()
    finally:
        other.close()
    operation.refresh_from_db()
    assert (operation.matched, operation.changed, operation.skipped) == (3, 2, 1)


def test_a_refused_request_writes_nothing() -> None:
    for kind, data in [
        ("purge", {}),
        ("retry", {"status": ["READY"]}),
        ("retry", {"queue": ""}),
        ("retry", {"nope": 1}),
        ("retry", {"workflow_id": True}),
        ("retry", {"enqueued_after": "yesterday"}),
        ("retry", {"enqueued_after": "2026-01-01T00:00:00"}),
        ("retry", {"kwargs_contains": []}),
        ("retry", {"args_contains": {"a": 1}}),
        ("retry", "queue=x"),
    ]:
        with pytest.raises(BulkFilterError):
            BulkOperation.objects.request(kind, data)
    assert not BulkOperation.objects.exists()


def test_the_batch_statement_reads_a_bounded_window(django_assert_max_num_queries) -> None:
    assert "LIMIT %(batch)s" in BULK_RETRY_SQL and "%(span)s" in BULK_RETRY_SQL
    make("FAILED", 50)
    BulkOperation.objects.request("retry", {})
    # The next open operation, then its one statement in a transaction of its own (BEGIN, it, COMMIT).
    with django_assert_max_num_queries(4):
        BulkRunner(batch_size=1000, span=20).run_batch()
    operation = BulkOperation.objects.get()
    assert operation.matched == 20 and operation.status == "RUNNING"


def test_an_operation_the_database_refuses_fails_and_the_next_one_runs() -> None:
    rows = make("FAILED", 3)
    # A filter written around the validation: its workflow id does not fit a bigint.
    broken = BulkOperation.objects.create(
        kind="retry", filter={"status": ["FAILED"], "workflow_id": 2**70}, last_id=max(rows)
    )
    BulkOperation.objects.request("retry", {})
    assert BulkRunner().run_until_idle() == 3
    broken.refresh_from_db()
    assert broken.status == "FAILED" and "out of range" in broken.error and broken.finished_at is not None
    assert statuses(rows) == {"READY": 3}


def test_a_batch_reads_its_window_not_the_table() -> None:
    from django.db import transaction

    from tasks.lifecycle.bulk import BULK_SQL, filter_params
    from tests.helpers.plans import explained, rows_read, seq_scans_of_tasks

    with connection.cursor() as cursor:
        # 60,000 tasks: half FAILED (a third of them in queue 'mail'), the rest SUCCESSFUL; none has the
        # argument searched for, so that search would read every failed task but for the window.
        cursor.execute(
            "INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,"
            " finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes,"
            " shared_crashes, unstarted_returns, attempt_started, attempt_isolated, errors_dropped)"
            " SELECT CASE WHEN g % 3 = 0 THEN 'mail' ELSE 'default' END, 0, 'app.x', '[]', '{}',"
            " CASE WHEN g % 2 = 0 THEN 'FAILED' ELSE 'SUCCESSFUL' END, now(), now(), now(), 1, 1, '[]', '[]',"
            " 0, 0, 0, 0, 0, 0, false, false, 0 FROM generate_series(1, 60000) AS g"
        )
        cursor.execute("VACUUM ANALYZE tasks_task")
    for data in ({"queue": "mail"}, {}, {"kwargs_contains": {"customer": 7}}):
        operation = BulkOperation.objects.request("retry", data)
        params = {
            "operation": operation.pk,
            "batch": 100,
            "span": 5000,
            "fair_queues": [],
            **filter_params(operation.filter),
        }
        with transaction.atomic():
            plan = explained(BULK_SQL["retry"], params)
            transaction.set_rollback(True)
        assert not seq_scans_of_tasks(plan), data
        # The window's ids (5,000) at most, whatever the table holds or the filter matches.
        assert max(n for _, n in rows_read(plan)) <= 5000 + 1, (data, rows_read(plan))
