"""A deposed recovery leader stopped (SIGSTOP, a long GC pause, a VM frozen) after
its bulk batch's statement ran and before its COMMIT holds the operation's row lock (the batch's
``FOR UPDATE``) and the rows it changed. The new leader runs bulk batches on its recovery thread,
between recovery rounds (tasks/maintenance/recovery.py, ``_recover``), without a lock timeout: its
next batch waits for that lock for as long as the stopped process lives, and recovery waits with it.
A worker SIGKILLed meanwhile must still have its task runnable again (invariant 7: within lease TTL +
recovery interval; what the test asserts at any speed: while the stopped leader's batch is still open).

The stopped leader's open transaction is played by a connection of the test that runs the very
statement a batch runs (``BULK_RETRY_SQL``) and does not commit, as a SIGSTOPped process would not.

Found by breaker 32 (the bug hunt on issue 25's operations: bulk operations, history, tracing, test helpers)."""

from __future__ import annotations

import os
import signal
from typing import Any

import psycopg
import pytest
from django.db import connection

from tasks.lifecycle.bulk import BULK_RETRY_SQL, filter_params
from tasks.models import BulkOperation, Task
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

TTL = 2.0
INTERVAL = 0.5


def test_a_stopped_leaders_open_batch_does_not_stop_recovery(processes: Any) -> None:
    failed = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{"n": i} for i in range(50)])
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET status = 'FAILED', finished_at = clock_timestamp() WHERE id = ANY(%s)", [failed]
        )
    operation = BulkOperation.objects.request("retry", {"task_path": "tests.testapp.handlers.noop"})
    # The deposed leader's batch: run, not committed.
    stopped = psycopg.connect(database_url())
    try:
        params = {
            "operation": operation.pk,
            "batch": 10,
            "span": 20,
            "fair_queues": [],
            **filter_params(operation.filter),
        }
        assert stopped.execute(BULK_RETRY_SQL, params).fetchone() is not None
        # The new leader, and a worker running a long task under a short lease.
        processes("recover_tasks", "--interval", str(INTERVAL), name="leader")
        long_task = Task.objects.enqueue("tests.testapp.handlers.work", kwargs={"seconds": 120}).id
        worker = processes(
            "run_worker", "--worker-id", "victim", "--no-recovery", "--ttl", str(TTL), "-v", "0", name="victim"
        )
        wait_until(
            lambda: Task.objects.filter(pk=long_task, status="RUNNING").exists(), 30, what="the long task to start"
        )
        # The new leader is now waiting for the stopped one's lock.
        wait_until(
            lambda: _waiting_on_the_operation(),
            30,
            interval=0.1,
            what="the new leader's batch to wait for the stopped leader's lock",
        )
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        # Invariant 7: runnable again while the stopped leader's batch still holds its lock (how soon
        # after TTL + recovery interval is the machine's load; the wait is a hang guard).
        recovered = wait_until(
            lambda: Task.objects.filter(pk=long_task).exclude(status="RUNNING").first(),
            120,
            interval=0.2,
            what=(
                "the dead worker's task to be recovered: the new recovery leader is stuck behind the stopped"
                " leader's open bulk batch"
            ),
        )
        assert recovered.status in ("READY", "FAILED"), recovered.status
        # Recovered while the stopped leader's batch still held its locks: its transaction is still open
        # on the server (it ends only below), so the recovery did not wait for it.
        assert _in_a_transaction(stopped.info.backend_pid)
    finally:
        stopped.close()  # the stopped process dies at last: its batch rolls back


def _waiting_on_the_operation() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT count(*) FROM pg_stat_activity
            WHERE datname = current_database() AND wait_event_type = 'Lock'
              AND query LIKE '%%tasks_bulkoperation%%' AND pid <> pg_backend_pid()
            """
        )
        return bool(cursor.fetchone()[0])


def _in_a_transaction(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND xact_start IS NOT NULL", [pid])
        return bool(cursor.fetchone()[0])
