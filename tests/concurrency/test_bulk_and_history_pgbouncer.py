"""The recovery leader's bulk runner and history rollup through PgBouncer in
transaction pooling with ONE server connection, shared with a client of someone else's (this test).
Between the leader's transactions that client gets the very server connection the leader used: it
must find no session state there (invariant 13): no setting changed from the server's defaults (JIT,
timeouts), no prepared statement, no advisory lock, no temporary table, no open LISTEN. And the work
gets done: the bulk retry ends DONE having retried each task once, the due hours are counted.

Found by breaker 32 (the bug hunt on issue 25's operations: bulk operations, history, tracing, test helpers)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from tasks.models import ActivityHourMark, BulkOperation, Task
from tests.helpers import start_manage, stop_process, wait_until
from tests.helpers.pgbouncer import Bouncer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

FAILED_ROWS = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at,
    last_attempted_at, finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions,
    failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, errors_dropped)
SELECT 'breaker32', 0, 'tests.testapp.handlers.noop', '[]', jsonb_build_object('n', g), 'FAILED',
       h - interval '2 seconds', h - interval '1 minute', h - interval '1 second', h - interval '1 second', h,
       1, 1, '[]', '[]', 0, 0, 1, 0, 0, 0, false, false, 0
FROM generate_series(1, %(n)s) AS g
CROSS JOIN LATERAL (SELECT date_trunc('hour', now()) - interval '3 hours' + (g %% 3600) * interval '1 second') AS t(h)
"""

STATE = """
SELECT current_setting('jit'), current_setting('statement_timeout'), current_setting('lock_timeout'),
       current_setting('idle_in_transaction_session_timeout'), current_setting('work_mem'),
       current_setting('search_path'), current_setting('application_name'),
       (SELECT count(*) FROM pg_prepared_statements),
       (SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'),
       (SELECT count(*) FROM pg_class WHERE relpersistence = 't'),
       (SELECT count(*) FROM pg_listening_channels()),
       pg_backend_pid()
"""


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[Any]:
    started: list[Any] = []

    def start(bouncer: Bouncer) -> Any:
        proc = start_manage(
            tmp_path / "leader.log",
            "recover_tasks",
            "--interval",
            "0.2",
            DATABASE_URL=bouncer.url(connection.settings_dict["NAME"]),
            DATABASE_POOLED="true",
            LEASING_TEST_BULK_BATCH_SIZE="40",
        )
        started.append(proc)
        return proc

    start.log = tmp_path / "leader.log"  # type: ignore[attr-defined]
    yield start
    for proc in started:
        stop_process(proc)


def test_the_bulk_runner_and_history_leave_no_session_state_on_a_pooled_connection(
    bouncer_pool_of_1: Bouncer, leader: Any
) -> None:
    with connection.cursor() as cursor:
        cursor.execute(FAILED_ROWS, {"n": 1200})
        cursor.execute("ANALYZE tasks_task")
    url = bouncer_pool_of_1.url(connection.settings_dict["NAME"])
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as probe:
        baseline = probe.execute(STATE).fetchone()
        assert baseline is not None
    operation = BulkOperation.objects.request("retry", {"queue": "breaker32"})
    proc = leader(bouncer_pool_of_1)
    seen: list[tuple[Any, ...]] = []

    def probe_state() -> bool:
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as probe:
            state = probe.execute(STATE).fetchone()
            assert state is not None
            seen.append(state)
        assert proc.poll() is None, leader.log.read_text()[-3000:]
        op = BulkOperation.objects.get(pk=operation.pk)
        hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=3)
        return op.status == "DONE" and ActivityHourMark.objects.filter(hour=hour).exists() and len(seen) > 20

    wait_until(probe_state, 120, interval=0.05, what="the bulk retry to end and the hour to be counted")
    stop_process(proc)
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as probe:
        last = probe.execute(STATE).fetchone()
        assert last is not None
        seen.append(last)
    differing = [state for state in seen if state[:-1] != baseline[:-1]]
    assert not differing, f"baseline {baseline}; left on the pooled connection: {differing[:5]}"
    assert len({state[-1] for state in seen}) == 1, "more than one server connection: the pool is not of one"
    operation.refresh_from_db()
    assert (operation.status, operation.matched, operation.changed, operation.skipped) == ("DONE", 1200, 1200, 0)
    assert Task.objects.filter(queue="breaker32", status="READY", attempts=0).count() == 1200
