"""Rate limits per key with real processes: six worker processes on one key
with a tiny window (5 starts per 0.5 s), three of them straight to PostgreSQL and three through a
real PgBouncer in transaction pooling, sync and async handlers and retried attempts on the key, and
this test's own HTTP client claiming through ``POST /api/tasks/next`` all along. Every charged
attempt of the key is recorded on the database clock by a trigger (whatever statement charges it),
and no sliding window of 0.5 s holds more than 5 of them. One worker is SIGSTOPped for longer than
its lease and SIGCONTed (its stale claims must take nothing and start nothing); one is SIGKILLed.

Found by breaker 32 (the bug hunt on issue 24's rate limits per key)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from tasks.models import FINISHED, RateLimit, Task, TaskStatus
from tests.helpers import sql_installed, wait_until
from tests.helpers import test_database_url as direct_url
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

KEY = "b32-tiny"
LIMIT, PERIOD = 5, 0.5

GRANTS = f"""
CREATE TABLE b32_rate_grants (task_id bigint, attempt int, at timestamptz, holder text);
CREATE FUNCTION b32_rate_grant() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO b32_rate_grants VALUES (NEW.id, NEW.attempts, NEW.last_attempted_at, NEW.holder);
    RETURN NEW;
END $$;
CREATE TRIGGER b32_rate_grant AFTER UPDATE OF attempts ON tasks_task
FOR EACH ROW WHEN (NEW.rate_key = '{KEY}' AND NEW.attempts > OLD.attempts)
EXECUTE FUNCTION b32_rate_grant();
"""
DROP = """
DROP TRIGGER IF EXISTS b32_rate_grant ON tasks_task;
DROP FUNCTION IF EXISTS b32_rate_grant();
DROP TABLE IF EXISTS b32_rate_grants;
"""


@pytest.fixture
def charged_attempts() -> Iterator[None]:
    with sql_installed(GRANTS, DROP):
        yield


def grant_rows() -> list[tuple[int, int, dt.datetime, str]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT task_id, attempt, at, holder FROM b32_rate_grants ORDER BY at")
        return list(cursor.fetchall())


def fullest_window(times: list[dt.datetime], period: float = PERIOD) -> tuple[int, list[dt.datetime]]:
    width = dt.timedelta(seconds=period)
    most: tuple[int, list[dt.datetime]] = (0, [])
    j = 0
    for i, start in enumerate(times):
        j = max(j, i)
        while j < len(times) and times[j] < start + width:
            j += 1
        if j - i > most[0]:
            most = (j - i, times[i:j])
    return most


def test_six_processes_sync_async_retries_pooled_and_the_api_on_a_tiny_window(
    workers: Workers, charged_attempts: None, bouncer_pool_of_4: Bouncer, settings: Any, client: Any
) -> None:
    settings.LEASING_API_TOKENS = ["b32-token"]
    dbname = connection.settings_dict["NAME"]
    pooled = {"DATABASE_URL": bouncer_pool_of_4.url(dbname), "DATABASE_POOLED": "true"}
    for n in range(3):
        workers.start(f"d{n}", "--concurrency", "4")
    for n in range(3):
        workers.start(f"p{n}", "--concurrency", "4", DIRECT_DATABASE_URL=direct_url(), **pooled)  # type: ignore[arg-type]

    # The backlog once every worker is up (a worker started first would take it all alone).
    ids: list[int] = []
    ids += Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 40, rate_key=KEY, rate_limit=(LIMIT, PERIOD))
    ids += Task.objects.bulk_enqueue(
        "tests.testapp.handlers.async_double", [{"n": 1}] * 40, rate_key=KEY, rate_limit=(LIMIT, PERIOD)
    )
    # Each fails its first attempt and is retried: the retry is a start of the key too.
    ids += Task.objects.bulk_enqueue(
        "tests.testapp.handlers.fail_until",
        [{"succeed_on": 2}] * 20,
        rate_key=KEY,
        rate_limit=(LIMIT, PERIOD),
        max_attempts=3,
    )
    # The HTTP client: claims through the API while the workers run, completes what it was given.
    headers = {"Authorization": "Bearer b32-token"}
    api_done = 0
    stopped = killed = False
    deadline_rows = 0

    def finished() -> int:
        return Task.objects.filter(pk__in=ids, status__in=FINISHED).count()

    def api_round() -> None:
        nonlocal api_done
        response = client.post(
            "/api/tasks/next",
            data=json.dumps({"worker": "b32-http", "limit": 2, "queues": ["default"]}),
            content_type="application/json",
            headers=headers,
        )
        assert response.status_code == 200, response.content
        for task in json.loads(response.content)["tasks"]:
            done = client.put(
                f"/api/tasks/{task['id']}/complete",
                data=json.dumps({"worker": "b32-http", "token": task["token"], "output": None}),
                content_type="application/json",
                headers=headers,
            )
            assert done.status_code in (200, 409), done.content
            api_done += 1

    def progress() -> bool:
        nonlocal stopped, killed, deadline_rows
        api_round()
        count = finished()
        if not stopped and len(grant_rows()) >= 10:
            # Freeze one direct worker (claims in hand) past its lease (ttl 2 s), then thaw it.
            os.kill(workers.procs["d0"].pid, signal.SIGSTOP)
            stopped = True
            deadline_rows = len(grant_rows())
        if stopped and not killed and len(grant_rows()) >= deadline_rows + 25:  # 2.5 s at the limit
            os.kill(workers.procs["d0"].pid, signal.SIGCONT)
            os.kill(workers.procs["p0"].pid, signal.SIGKILL)
            killed = True
        return count == len(ids)

    wait_until(progress, 120, 0.05, what="every task of the key to finish")

    rows = grant_rows()
    times = [r[2] for r in rows]
    most, window = fullest_window(times)
    assert most <= LIMIT, f"{most} starts of {KEY} within {PERIOD}s: {window}"
    assert killed, "the backlog finished before the SIGSTOP / SIGKILL sequence completed"
    final = list(
        Task.objects.filter(pk__in=ids).values_list("status", "attempts", "crashes", "task_path", "worker_ids")
    )
    assert all(status == TaskStatus.SUCCESSFUL for status, *_ in final), final
    # Retries were starts of the key, counted and recorded (the HTTP client completes what it is given
    # without running it: a fail_until it took first succeeds at once).
    retried = [(a, w) for _, a, _, path, w in final if path.endswith("fail_until")]
    assert all(a >= 2 or "b32-http" in w for a, w in retried), retried
    charged = sum(a for _, a, *_ in final)
    assert len(rows) == charged, (len(rows), charged)
    key = RateLimit.objects.get(key=KEY)
    assert key.grants >= charged
    holders: dict[str, int] = {}
    for row in rows:
        holders[row[3] or "?"] = holders.get(row[3] or "?", 0) + 1
    print("grants by holder:", sorted(holders.items()))
    print(
        f"grants={len(rows)} fullest={most} api={api_done} refusals={key.refusals} "
        f"span={(times[-1] - times[0]).total_seconds():.1f}s"
    )
