"""Bulk operations: three operations on overlapping filters, worked by two
runners at once (a deposed leader that has not noticed yet beside the new one), while real worker
processes claim, run and finish the same tasks, an operator requeues failed ones and retention
deletes finished ones.

Every status change of a task is recorded by a row trigger (with whether the statement that made it
was a bulk batch). The promises checked:

- a RUNNING task is never touched by a bulk statement;
- each task is changed at most once per operation (a retry operation makes a task READY at most
  once; the cancel operation cancels it at most once);
- each operation's ``changed`` is exactly the changes its statements made; ``matched = changed +
  skipped``; every operation ends DONE.


Found by breaker 32 (the bug hunt on issue 25's operations: bulk operations, history, tracing, test helpers)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import close_old_connections, connection, connections

from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Task
from tests.helpers import sql_installed, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

WORK = "tests.testapp.handlers.work"
TASKS = 2400

# Interleaved ids: FAILED, CANCELLED, READY (the workers claim those), SUCCESSFUL, by id % 4;
# a third of them in group 1 (the second retry's filter).
FILL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, errors_dropped)
SELECT 'default', 0, %(path)s, '[]', jsonb_build_object('seconds', 0.002, 'grp', g %% 3, 'n', g),
       (ARRAY['FAILED', 'CANCELLED', 'READY', 'SUCCESSFUL'])[1 + g %% 4], now(), now(),
       CASE WHEN g %% 4 = 2 THEN NULL ELSE now() END, 1, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false, 0
FROM generate_series(1, %(n)s) AS g
"""

AUDIT = """
CREATE TABLE breaker32_audit (
    seq bigserial PRIMARY KEY, task_id bigint NOT NULL, old_status text, new_status text, bulk boolean, grp int
);
CREATE FUNCTION breaker32_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO breaker32_audit (task_id, old_status, new_status, bulk, grp)
    VALUES (NEW.id, OLD.status, NEW.status, current_query() LIKE '%%tasks_bulkoperation%%', (NEW.kwargs->>'grp')::int);
    RETURN NULL;
END $$;
CREATE TRIGGER breaker32_audit AFTER UPDATE ON tasks_task FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION breaker32_audit();
"""
UNAUDIT = """
DROP TRIGGER IF EXISTS breaker32_audit ON tasks_task;
DROP FUNCTION IF EXISTS breaker32_audit();
DROP TABLE IF EXISTS breaker32_audit;
"""


@pytest.fixture
def audited() -> Iterator[None]:
    with sql_installed(AUDIT, UNAUDIT):
        yield


def in_thread(target: Any, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_overlapping_operations_two_runners_workers_requeues_and_pruning(audited: None, processes: Any) -> None:
    with connection.cursor() as cursor:
        cursor.execute(FILL, {"path": WORK, "n": TASKS})
        cursor.execute("ANALYZE tasks_task")
    for i in range(2):
        processes("run_worker", "--worker-id", f"b{i}", "--no-recovery", "--concurrency", "4", "-v", "0", name=f"b{i}")
    retry_all = BulkOperation.objects.request("retry", {"task_path": WORK})
    cancel_ready = BulkOperation.objects.request("cancel", {"kwargs_contains": {"grp": 2}, "status": "READY"})
    retry_group = BulkOperation.objects.request(
        "retry", {"kwargs_contains": {"grp": 1}, "status": ["FAILED", "CANCELLED", "SUCCESSFUL"]}
    )
    operations = [retry_all, cancel_ready, retry_group]
    stop = threading.Event()
    errors: list[BaseException] = []

    def runner() -> None:
        BulkRunner(batch_size=5, span=30).run_until_idle()

    def operator() -> None:
        rng = random.Random(32)
        while not stop.is_set():
            close_old_connections()
            ids = list(Task.objects.filter(status="FAILED").values_list("pk", flat=True)[:500])
            Task.objects.filter(pk__in=rng.sample(ids, min(10, len(ids))), status="FAILED").requeue()
            done = list(Task.objects.filter(status="SUCCESSFUL").values_list("pk", flat=True)[:500])
            Task.objects.filter(pk__in=rng.sample(done, min(5, len(done))), status="SUCCESSFUL").delete()
            stop.wait(0.01)

    side = in_thread(operator, errors)
    runners = [in_thread(runner, errors) for _ in range(2)]
    for thread in runners:
        thread.join(300)
    stop.set()
    side.join(30)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in runners)

    for operation in operations:
        operation.refresh_from_db()
    summary = [(o.kind, o.status, o.matched, o.changed, o.skipped, o.error) for o in operations]
    assert all(o.status == "DONE" for o in operations), summary
    assert all(o.matched == o.changed + o.skipped for o in operations), summary

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM breaker32_audit WHERE bulk AND old_status = 'RUNNING'")
        assert cursor.fetchone()[0] == 0, "a bulk statement changed a RUNNING task"
        cursor.execute(
            "SELECT new_status, count(*) FROM breaker32_audit WHERE bulk GROUP BY new_status ORDER BY new_status"
        )
        by_status = dict(cursor.fetchall())
        assert by_status.get("CANCELLED", 0) == cancel_ready.changed, (by_status, summary)
        assert by_status.get("READY", 0) == retry_all.changed + retry_group.changed, (by_status, summary)
        assert set(by_status) <= {"READY", "CANCELLED"}, by_status
        # At most once per operation: group-1 tasks match both retries, the others only the first. The
        # group is the one the audit row saw: retention may have deleted the task since.
        cursor.execute(
            """
            SELECT a.task_id, a.new_status, count(*), a.grp
            FROM breaker32_audit AS a
            WHERE a.bulk GROUP BY a.task_id, a.new_status, a.grp
            HAVING count(*) > CASE WHEN a.new_status = 'READY' THEN 2 ELSE 1 END
                OR (a.new_status = 'READY' AND count(*) > 1 AND a.grp IS DISTINCT FROM 1)
            """
        )
        twice = cursor.fetchall()
    assert not twice, f"changed more than once per operation: {twice[:20]}"
    print(f"\nbulk race: {summary}; bulk changes by new status {by_status}")
    wait_until(
        lambda: not Task.objects.filter(status__in=["READY", "RUNNING"]).exists(),
        120,
        interval=0.25,
        what="the workers to drain what was retried",
    )
