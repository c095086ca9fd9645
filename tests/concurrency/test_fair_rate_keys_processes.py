"""A fair queue whose keys also carry rate and concurrency keys, with real worker processes: one
tenant ("mail") is rate-limited to 5 starts a second with a backlog it cannot finish quickly, twenty
others each have a concurrency key of limit 2; three workers claim, one is SIGKILLed mid-run and
replaced, the queue is paused and resumed meanwhile, and once the others are done an operator
cancels what the rate-limited tenant still has waiting. Once with the workers connected directly,
once with every worker through PgBouncer in transaction pooling (a pool of 4 server connections for
the four workers' sessions).

What must hold: the others end SUCCESSFUL, the rate-limited tenant's tasks SUCCESSFUL or CANCELLED;
each ran once, except an attempt the SIGKILL cut (its task then shows the crash); no sliding
one-second window of the database clock holds more than 5 starts of the rate key (a claim the key
refuses goes back and keeps its place, it is not started); the other tenants are not held behind the
rate-limited one (their last task ends while its backlog still waits); no concurrency key ever runs
more than its limit at once."""

from __future__ import annotations

import datetime as dt
import os
import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from django.db import connection

from tasks.models import QueueControl, Task
from tests.concurrency.test_rate_limit_processes import fullest_window
from tests.helpers import sql_installed, wait_until
from tests.helpers.pgbouncer import pgbouncer
from tests.helpers.workers import Workers
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

MIX = "tests.testapp.outcome_handlers.fair_mix"
LIMIT = 5
#: 80 s of the key's rate: the others (600 short tasks) are done long before it at any speed this
#: test can finish at, and an operator cancels what is left of it then.
MAIL = 400
TENANTS, PER_TENANT, SLOTS = 20, 30, 2

# Every start of an attempt, with its keys: when the start was recorded (``at``) and the start the
# row records (``granted``: last_attempted_at, the rate grant's time on the database clock). A start
# that bypassed the rate grant or a key's limit would be recorded too.
STARTS = """
CREATE TABLE test_fair_rate_starts (
    task_id bigint, at timestamptz, granted timestamptz, rate_key text, concurrency_key text
);
CREATE FUNCTION test_fair_rate_start() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO test_fair_rate_starts
    VALUES (NEW.id, clock_timestamp(), NEW.last_attempted_at, NEW.rate_key, NEW.concurrency_key);
    RETURN NEW;
END $$;
CREATE TRIGGER test_fair_rate_start AFTER UPDATE OF attempt_started ON tasks_task
FOR EACH ROW WHEN (NEW.attempt_started AND NOT OLD.attempt_started AND NEW.queue = 'tenants')
EXECUTE FUNCTION test_fair_rate_start();
"""
DROP = """
DROP TRIGGER IF EXISTS test_fair_rate_start ON tasks_task;
DROP FUNCTION IF EXISTS test_fair_rate_start();
DROP TABLE IF EXISTS test_fair_rate_starts;
"""


@pytest.fixture
def starts() -> Iterator[None]:
    with sql_installed(STARTS, DROP):
        yield


def _mail_starts() -> list[dt.datetime]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT granted FROM test_fair_rate_starts WHERE rate_key = 'mail' ORDER BY granted")
        return [row[0] for row in cursor.fetchall()]


@pytest.fixture(params=["direct", "pgbouncer"])
def direct_or_pooled_env(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    env = {"LEASING_TEST_FAIR_QUEUES": "tenants"}
    with ExitStack() as stack:
        if request.param == "pgbouncer":
            bouncer = stack.enter_context(pgbouncer(connection.settings_dict, pool_size=4))
            env |= {"DATABASE_URL": bouncer.url(connection.settings_dict["NAME"]), "DATABASE_POOLED": "true"}
        yield env


def test_rate_and_concurrency_keys_inside_a_fair_queue(
    workers: Workers, starts: None, direct_or_pooled_env: dict[str, str]
) -> None:
    env = direct_or_pooled_env
    args = ("--queues", "tenants", "--concurrency", "4", "--batch-size", "8")
    mail = Task.objects.bulk_enqueue(
        MIX, [{"mode": "plain"}] * MAIL, queue="tenants", fair_key="mail", rate_key="mail", rate_limit=f"{LIMIT}/s"
    )
    for name in ("fr-1", "fr-2", "fr-3"):
        workers.start(name, *args, may_die=False, **env)
    others: list[int] = []
    for tenant in range(TENANTS):
        others += Task.objects.bulk_enqueue(
            MIX,
            [{"mode": "plain", "seconds": 0.02}] * PER_TENANT,
            queue="tenants",
            fair_key=f"tenant-{tenant:02d}",
            concurrency_key=f"slots-{tenant:02d}",
            concurrency_limit=SLOTS,
        )
    every = mail + others
    wait_until(lambda: Effect.objects.filter(task_id__in=others).count() >= len(others) // 4, 60, what="a quarter")
    # SIGKILL one worker with attempts and (likely) refused claims in hand; a new one takes its place.
    victim = workers.procs["fr-1"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    workers.start("fr-4", *args, "--recovery-interval", "0.2", may_die=False, **env)
    wait_until(lambda: Effect.objects.filter(task_id__in=others).count() >= len(others) // 2, 60, what="a half")
    QueueControl.objects.pause("tenants", by="test", reason="mid-drain")
    # Paused: no claim takes more, so what the workers hold runs out (a backlog waits all along).
    wait_until(lambda: not Task.objects.filter(queue="tenants", status="RUNNING").exists(), 30, 0.05, what="the pause")
    paused_at = Effect.objects.filter(task_id__in=every).count()
    assert Task.objects.filter(queue="tenants", status="READY").exists()
    QueueControl.objects.resume("tenants", by="test")
    wait_until(
        lambda: not Task.objects.filter(pk__in=others).exclude(status="SUCCESSFUL").exists(),
        120,
        0.2,
        what="every other tenant's task successful",
    )
    mail_done_then = Task.objects.filter(pk__in=mail, status="SUCCESSFUL").count()
    # The others were not held behind it: they were all done while its backlog still waited (how
    # much of it then is a share of the machine's speed: bench/rate_limits.py measures the key's rate).
    assert mail_done_then < MAIL, (mail_done_then, paused_at)
    # An operator cancels the rest of the rate-limited backlog (those waiting; a running one ends).
    Task.objects.filter(pk__in=mail, status__in=["READY", "BLOCKED"]).cancel()
    wait_until(
        lambda: not Task.objects.filter(pk__in=mail, status__in=["READY", "BLOCKED", "RUNNING"]).exists(),
        120,
        0.2,
        what="the rate-limited backlog ended (run or cancelled)",
    )

    # Each task ran once, or again where the SIGKILL cut a run: the task records it, as a crash (shared:
    # the worker ran several) or, for a run killed before its start was recorded (the marker's 20 ms),
    # as an unstarted return (docs/explanation/fault-model.md, "Attempt accounting"). A cancelled one
    # ran at most what its crashes say.
    fields = ("id", "attempts", "crashes", "shared_crashes", "unstarted_returns", "status")
    rows = {r["id"]: r for r in Task.objects.filter(pk__in=every).values(*fields)}
    assert {rows[t]["status"] for t in others} == {"SUCCESSFUL"}
    assert {rows[t]["status"] for t in mail} <= {"SUCCESSFUL", "CANCELLED"}
    runs = Counter(Effect.objects.filter(task_id__in=every, phase="done").values_list("task_id", flat=True))
    missing = [t for t in every if runs[t] == 0 and rows[t]["status"] == "SUCCESSFUL"]
    unexplained = [
        (t, runs[t], rows[t])
        for t in every
        if runs[t]
        > int(rows[t]["status"] == "SUCCESSFUL")
        + rows[t]["crashes"]
        + rows[t]["shared_crashes"]
        + rows[t]["unstarted_returns"]
    ]
    assert not missing, missing[:10]
    assert not unexplained, unexplained[:10]

    # The rate key's starts: never more than the limit in any sliding second of the database clock.
    times = _mail_starts()
    assert len(times) >= Task.objects.filter(pk__in=mail, status="SUCCESSFUL").count()
    assert fullest_window(times) <= LIMIT, fullest_window(times)

    # No concurrency key ever ran more than its limit: replay starts and ends on the database clock.
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT s.concurrency_key, max(n) FROM (
                SELECT s.concurrency_key, s.at, (
                    SELECT count(*) FROM test_fair_rate_starts AS o JOIN tasks_task AS t ON t.id = o.task_id
                    WHERE o.concurrency_key = s.concurrency_key AND o.at <= s.at AND t.finished_at > s.at
                      AND NOT EXISTS (
                          SELECT 1 FROM test_fair_rate_starts AS later
                          WHERE later.task_id = o.task_id AND later.at > o.at AND later.at <= s.at)
                ) AS n
                FROM test_fair_rate_starts AS s WHERE s.concurrency_key IS NOT NULL
            ) AS s GROUP BY 1 HAVING max(n) > %s
            """,
            [SLOTS],
        )
        over = cursor.fetchall()
    assert not over, over
    print(
        f"fullest second of the rate key {fullest_window(times)}; its tasks done when the others were {mail_done_then}"
    )
