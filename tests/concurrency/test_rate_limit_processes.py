"""Rate limits per key with real worker processes (issue 24's acceptance test): a limit of 20 starts
per second on one key, three worker processes, 20 seconds, other keys flowing. Every grant of the
key is recorded on the database clock by a trigger (whatever statement starts an attempt), and no
sliding one-second window holds more than 20 of them; the other keys' tasks are never refused by it;
a SIGKILLed worker takes no budget with it (the key goes on granting after). The rates themselves
(the limit used, the others' wait) are bench/rate_limits.py's."""

from __future__ import annotations

import datetime as dt
import os
import signal
import statistics
import time
from collections.abc import Iterator

import pytest
from django.db import connection

from tasks.models import RateLimit, Task
from tests.helpers import sql_installed, wait_until
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

LIMIT, PERIOD = 20, 1.0
RUN_FOR = 20.0

# Every start of a "mail" attempt, as the row records it (last_attempted_at, on the database clock):
# a start that bypassed the grant would be recorded too.
GRANTS_TABLE = """
CREATE TABLE test_rate_grants (task_id bigint, at timestamptz);
CREATE FUNCTION test_rate_grant() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO test_rate_grants VALUES (NEW.id, NEW.last_attempted_at);
    RETURN NEW;
END $$;
CREATE TRIGGER test_rate_grant AFTER UPDATE OF attempt_started ON tasks_task
FOR EACH ROW WHEN (NEW.rate_key = 'mail' AND NEW.attempt_started AND NOT OLD.attempt_started)
EXECUTE FUNCTION test_rate_grant();
"""
DROP_GRANTS = """
DROP TRIGGER IF EXISTS test_rate_grant ON tasks_task;
DROP FUNCTION IF EXISTS test_rate_grant();
DROP TABLE IF EXISTS test_rate_grants;
"""


@pytest.fixture
def grants() -> Iterator[None]:
    with sql_installed(GRANTS_TABLE, DROP_GRANTS):
        yield


def grant_times() -> list[dt.datetime]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT at FROM test_rate_grants ORDER BY at")
        return [row[0] for row in cursor.fetchall()]


def fullest_window(times: list[dt.datetime], period: float = PERIOD) -> int:
    """The most grants in any half-open window [t, t + period) of the database clock."""
    width = dt.timedelta(seconds=period)
    most, j = 0, 0
    for i, start in enumerate(times):
        j = max(j, i)
        while j < len(times) and times[j] < start + width:
            j += 1
        most = max(most, j - i)
    return most


def test_twenty_per_second_across_three_processes_and_a_sigkill(workers: Workers, grants: None) -> None:
    # A backlog the key cannot finish in the run (20/s for 20 s is 400 starts).
    Task.objects.bulk_enqueue(NOOP, [{}] * 1500, rate_key="mail", rate_limit=f"{LIMIT}/s")
    for i in range(3):
        # The default poll interval (2 s, longer than the key's period): a worker must look for its
        # refused claims when they come due, not at its next poll, or the key would run at half rate.
        workers.start(f"w{i}", "--concurrency", "4", "--poll-interval", "2")
    wait_until(lambda: grant_times(), 30, what="the first grant")
    began = time.monotonic()
    others: list[int] = []
    killed_at: float | None = None
    while (elapsed := time.monotonic() - began) < RUN_FOR:
        # Other work flowing all along: unkeyed tasks, and another rate key far from its limit.
        others += Task.objects.bulk_enqueue(NOOP, [{}] * 5)
        others += Task.objects.bulk_enqueue(NOOP, [{}] * 5, rate_key="reports", rate_limit="1000/s")
        if killed_at is None and elapsed > 10:
            # SIGKILL one worker mid-run, with grants and claims in hand.
            os.kill(workers.procs["w0"].pid, signal.SIGKILL)
            workers.procs["w0"].wait(10)
            killed_at = time.monotonic()
        time.sleep(0.25)  # the feeder's pace (not a synchronisation: nothing waits on it)
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        ended_at = cursor.fetchone()[0]
    times = [t for t in grant_times() if t <= ended_at]

    # The guarantee: no sliding one-second window holds more than 20 starts of the key.
    assert fullest_window(times) <= LIMIT, fullest_window(times)
    # The key ran all along, and on after the SIGKILL (a worker that died with grants in hand takes
    # no budget with it). At what rate is a figure of the machine: bench/rate_limits.py measures it.
    span = (times[-1] - times[0]).total_seconds()
    assert killed_at is not None
    kill_db = ended_at - dt.timedelta(seconds=time.monotonic() - killed_at)
    after = [t for t in times if t > kill_db + dt.timedelta(seconds=3 * PERIOD)]
    after_span = (ended_at - (kill_db + dt.timedelta(seconds=3 * PERIOD))).total_seconds()
    wait_until(
        lambda: any(t > kill_db + dt.timedelta(seconds=3 * PERIOD) for t in grant_times()),
        60,
        what="a grant of the key once the killed worker's grants left the window",
    )

    # The other keys are not held by it: every one of them ran.
    wait_until(
        lambda: not Task.objects.filter(pk__in=others).exclude(status="SUCCESSFUL").exists(),
        60,
        0.2,
        what="the other tasks to finish",
    )
    waits = sorted(
        (started - enqueued).total_seconds()
        for started, enqueued in Task.objects.filter(pk__in=others).values_list("last_attempted_at", "enqueued_at")
        if started is not None
    )
    p95 = waits[int(len(waits) * 0.95)]
    # Not one of them was refused by the key's limit (how soon each started is the machine's figure).
    assert not Task.objects.filter(pk__in=others, rate_refusals__gt=0).exists()

    # Hand-backs of the backlog: what the spread costs (printed for the report).
    key = RateLimit.objects.get(key="mail")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT rate_refusals, count(*) FROM tasks_task WHERE rate_key = 'mail' AND attempts > 0"
            " GROUP BY 1 ORDER BY 1"
        )
        print("refusals per started task:", cursor.fetchall())
    print(
        f"grants={len(times)} over {span:.1f}s ({len(after) / after_span:.1f}/s after the kill) "
        f"fullest window={fullest_window(times)} "
        f"refusals={key.refusals} (per grant {key.refusals / max(key.grants, 1):.2f}) "
        f"others={len(others)} wait median={statistics.median(waits):.3f}s p95={p95:.3f}s"
    )
