"""Rate limits per key: a task with a rate key and a concurrency key, run by
a real worker (threads and an event loop) with its recovery on. A refused keyed task waits BLOCKED
(its concurrency slot given up) until its reserved time: it must be admitted again and run then,
though no other task of its concurrency key finishes to admit it; both limits hold on the database
clock (at most 2 starts per 0.6 s; at most 2 attempts of the concurrency key RUNNING at once).

Found by breaker 32 (the bug hunt on issue 24's rate limits per key)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pytest
from django.db import connection

from tasks.models import FINISHED, Task, TaskStatus
from tasks.worker.process import Worker
from tests.helpers import sql_installed, wait_until, worker_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

# Every change of a task of the concurrency key into or out of RUNNING, on the database clock.
TRACE = """
CREATE TABLE b32_running (task_id bigint, at timestamptz, delta int, attempt int, last_attempted_at timestamptz);
CREATE FUNCTION b32_running() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'RUNNING' AND OLD.status <> 'RUNNING' THEN
        INSERT INTO b32_running VALUES (NEW.id, clock_timestamp(), 1, NEW.attempts, NULL);
    ELSIF OLD.status = 'RUNNING' AND NEW.status <> 'RUNNING' THEN
        INSERT INTO b32_running VALUES (NEW.id, clock_timestamp(), -1, NEW.attempts, NEW.last_attempted_at);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER b32_running AFTER UPDATE OF status ON tasks_task
FOR EACH ROW WHEN (NEW.concurrency_key = 'b32-conc') EXECUTE FUNCTION b32_running();
"""
DROP = """
DROP TRIGGER IF EXISTS b32_running ON tasks_task;
DROP FUNCTION IF EXISTS b32_running();
DROP TABLE IF EXISTS b32_running;
"""


@pytest.fixture
def trace() -> Iterator[None]:
    with sql_installed(TRACE, DROP):
        yield


@pytest.mark.parametrize("handler", ["tests.testapp.handlers.work", "tests.testapp.handlers.async_sleep"])
def test_a_rate_and_a_concurrency_key_together_run_everything_within_both_limits(trace: None, handler: str) -> None:
    kwargs = {"seconds": 0.05}
    ids = Task.objects.bulk_enqueue(
        handler,
        [kwargs] * 10,
        rate_key="b32-rate",
        rate_limit=(2, 0.6),
        concurrency_key="b32-conc",
        concurrency_limit=2,
    )
    worker = Worker(
        concurrency=4, ttl=10, poll_interval=5, recovery_interval=0.2, install_signal_handlers=False, worker_id="b32c"
    )
    with worker_in_thread(worker):
        wait_until(
            lambda: Task.objects.filter(pk__in=ids, status__in=FINISHED).count() == 10,
            40,
            what="every task of both keys to finish",
        )
    rows = list(Task.objects.filter(pk__in=ids))
    assert all(r.status == TaskStatus.SUCCESSFUL and r.attempts == 1 for r in rows), [
        (r.id, r.status, r.attempts, r.errors) for r in rows
    ]
    assert sum(r.rate_refusals for r in rows) > 0  # the rate limit did refuse some
    starts = sorted(r.last_attempted_at for r in rows if r.last_attempted_at is not None)
    assert len(starts) == len(rows)
    window = dt.timedelta(seconds=0.6)
    most = max(sum(1 for s in starts[i:] if s < at + window) for i, at in enumerate(starts))
    assert most <= 2, starts
    with connection.cursor() as cursor:
        cursor.execute("SELECT delta FROM b32_running ORDER BY at")
        deltas = [d for (d,) in cursor.fetchall()]
    running = peak = 0
    for d in deltas:
        running += d
        peak = max(peak, running)
    assert peak <= 2, deltas
