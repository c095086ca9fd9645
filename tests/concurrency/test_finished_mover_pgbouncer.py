"""The mover on by default, in a real recovery leader (``manage.py recover_tasks``) behind PgBouncer in
transaction pooling with ONE server connection shared with a client of someone else's (this test):
the backlog of finished tasks hours old moves (each task in exactly one table, none lost), the day
partitions are made through the pooler, and between the leader's transactions the other client
finds no session state on that server connection (invariant 13)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from tests.concurrency.test_bulk_and_history_pgbouncer import STATE
from tests.db.test_finished_mover import roll_up_hours
from tests.db.test_finished_partitions import drop_partitions
from tests.helpers import start_manage, stop_process, wait_until
from tests.helpers.pgbouncer import Bouncer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SUCCEEDED_ROWS = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at,
    last_attempted_at, finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions,
    failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, errors_dropped)
SELECT 'mover60', 0, 'tests.testapp.handlers.noop', '[]', jsonb_build_object('n', g), 'SUCCESSFUL',
       h - interval '2 seconds', h - interval '1 minute', h - interval '1 second', h - interval '1 second', h,
       1, 1, '[]', '[]', 0, 0, 0, 0, 0, 0, true, false, 0
FROM generate_series(1, %(n)s) AS g
CROSS JOIN LATERAL (SELECT date_trunc('hour', now()) - interval '3 hours' + (g %% 3600) * interval '1 second') AS t(h)
"""


@pytest.fixture(autouse=True)
def no_partitions() -> Iterator[None]:
    drop_partitions()
    yield
    drop_partitions()


def test_the_mover_through_a_pool_of_one_moves_the_backlog_and_leaves_no_session_state(
    bouncer_pool_of_1: Bouncer, tmp_path: Path
) -> None:
    n = 1500
    with connection.cursor() as cursor:
        cursor.execute(SUCCEEDED_ROWS, {"n": n})
        cursor.execute("ANALYZE tasks_task")
    roll_up_hours()  # the hours counted, 6 minutes ago: the mover may take them at once
    url = bouncer_pool_of_1.url(connection.settings_dict["NAME"])
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as probe:
        baseline = probe.execute(STATE).fetchone()
        assert baseline is not None
    log = tmp_path / "leader.log"
    proc = start_manage(
        log,
        "recover_tasks",
        "--interval",
        "0.2",
        DATABASE_URL=url,
        DATABASE_POOLED="true",
    )
    seen: list[tuple[Any, ...]] = []

    def moved() -> bool:
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as probe:
            state = probe.execute(STATE).fetchone()
            assert state is not None
            seen.append(state)
        assert proc.poll() is None, log.read_text()[-3000:]
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM tasks_finished WHERE queue = 'mover60'")
            return cursor.fetchone()[0] == n and len(seen) > 20

    try:
        wait_until(moved, 180, interval=0.05, what="the backlog to move")
    finally:
        stop_process(proc)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT (SELECT count(*) FROM tasks_task WHERE queue = 'mover60'),"
            " (SELECT count(*) FROM tasks_finished WHERE queue = 'mover60'),"
            " (SELECT count(DISTINCT id) FROM tasks_finished WHERE queue = 'mover60')"
        )
        assert cursor.fetchone() == (0, n, n)
    differing = [state for state in seen if state[:-1] != baseline[:-1]]
    assert not differing, f"baseline {baseline}; left on the pooled connection: {differing[:5]}"
    assert len({state[-1] for state in seen}) == 1, "more than one server connection: the pool is not of one"
