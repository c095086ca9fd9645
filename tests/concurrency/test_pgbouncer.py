"""The whole project through a real PgBouncer in transaction pooling, with a small pool.

Workers (with their recovery controller, scheduler and lease heartbeats) drain tasks through the
pooler while some of them are SIGKILLed; the dashboard and /metrics are served through it. Nothing
is lost, no attempt runs twice, and afterwards every server connection of the pool still has the
server's default ``statement_timeout`` and ``lock_timeout``: nothing the project set outlived its
transaction (a session-level setting there lands on the next client's web request).
"""

from __future__ import annotations

import json
import os
import signal
from collections import defaultdict
from typing import Any

import psycopg
import pytest
from django.db import connection

from leasing.models import Lease
from tasks.maintenance.recovery import RECOVERY_LEASE
from tasks.models import Task, TaskStatus
from tasks.models.schedule import ScheduleRun
from tests.helpers import ROOT, child_env, wait_until
from tests.helpers import test_database_url as direct_url
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.workers import Workers
from tests.helpers.zygote import run_python
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

#: 1,000 tasks, four kills at every sixth of them: each kill still lands mid-drain (2,000 doubled
#: the work, a minute of a loaded two-core machine, and no kill more).
TASKS = 1000
KILLS = 4
SCHEDULES = {"tick": {"task": "tests.testapp.handlers.noop", "interval": 1, "catch_up": "last"}}


def server_pids() -> set[int]:
    """Client backends on the test database other than this test's own: the pooler's server
    connections. (Not every backend: an autovacuum worker on the test database is listed there too,
    with a database of its own, and it would stand in the count for a pool connection.)"""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"
        )
        return {row[0] for row in cursor.fetchall()}


def settings_of_every_server_connection(bouncer: Bouncer, dbname: str) -> dict[int, tuple[str, str]]:
    """Fresh clients through the pool, one per server connection, each inside a transaction (so
    each holds a server connection of its own while the others read): pid -> (statement_timeout,
    lock_timeout)."""
    clients = [psycopg.connect(bouncer.conninfo(dbname)) for _ in range(bouncer.pool_size)]
    try:
        read = {}
        for client in clients:
            row = client.execute(
                "SELECT pg_backend_pid(), current_setting('statement_timeout'), current_setting('lock_timeout')"
            ).fetchone()
            assert row is not None
            read[row[0]] = (row[1], row[2])
        return read
    finally:
        for client in clients:
            client.rollback()
            client.close()


def dashboard_through(url: str) -> str:
    """GET the dashboard, a state list and /metrics as staff in a process whose database is ``url``."""
    script = """
import django
django.setup()
from django.contrib.auth import get_user_model
from django.test import Client
from django.test.utils import setup_test_environment
from django.urls import reverse
setup_test_environment()
staff = {"is_staff": True, "is_superuser": True}
user, _ = get_user_model().objects.get_or_create(username="bouncer-staff", defaults=staff)
client = Client()
client.force_login(user)
for path in (reverse("tasks:overview"), reverse("tasks:task-state", args=["succeeded"]), reverse("metrics")):
    response = client.get(path)
    print(path, response.status_code, len(response.content))
    assert response.status_code == 200, (path, response.status_code)
"""
    done = run_python(
        ["-c", script],
        cwd=ROOT,
        env=child_env(DATABASE_URL=url, DATABASE_POOLED="true"),
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_drain_with_kills_through_pgbouncer_leaves_no_session_settings(
    bouncer_pool_of_4: Bouncer, workers: Workers
) -> None:
    dbname = connection.settings_dict["NAME"]
    ours = server_pids()  # connections that are not the pooler's (none, normally)
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.record", [{"n": n} for n in range(TASKS)])
    pooled: dict[str, Any] = {
        "DATABASE_URL": bouncer_pool_of_4.url(dbname),
        "DATABASE_POOLED": "true",
        "LEASING_TEST_SCHEDULES": json.dumps(SCHEDULES),
    }
    # One worker LISTENs on a direct URL (the documented set-up); the others poll through the pooler.
    workers.start("bw-0", "--concurrency", "4", DIRECT_DATABASE_URL=direct_url(), **pooled)
    for n in (1, 2):
        workers.start(f"bw-{n}", "--concurrency", "4", **pooled)
    # The start line says how each wakes up.
    wait_until(lambda: "wake-up=LISTEN on the direct URL of default" in workers.log("bw-0"), 30, what="bw-0 start")
    wait_until(lambda: "wake-up=polling every 0.2s (default is pooled" in workers.log("bw-1"), 30, what="bw-1 start")

    def listeners() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND"
                " query LIKE 'LISTEN leasing_tasks%%'"
            )
            return int(cursor.fetchone()[0])

    wait_until(lambda: listeners() == 1, 30, what="bw-0's LISTEN, straight to the server")

    def succeeded() -> int:
        return Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL).count()

    generation = 3
    for kill in range(KILLS):
        target = (kill + 1) * TASKS // (KILLS + 2)
        wait_until(lambda: succeeded() >= target, 300, what="progress before a kill")  # noqa: B023
        victim = sorted(name for name, proc in workers.procs.items() if proc.poll() is None)[kill % 3]
        os.kill(workers.procs[victim].pid, signal.SIGKILL)
        workers.procs[victim].wait(30)
        workers.start(f"bw-{generation}", "--concurrency", "4", **pooled)
        generation += 1
    wait_until(lambda: succeeded() == TASKS, 300, what="every task to succeed")

    # Nothing lost, nothing run twice: every task ran to completion under the token it finished
    # with, and no attempt (task + token) ran more than once.
    assert Task.objects.filter(pk__in=ids).exclude(status=TaskStatus.SUCCESSFUL).count() == 0
    runs: dict[int, list[int]] = defaultdict(list)
    for task_id, token in Effect.objects.filter(task_id__in=ids, phase="done").values_list("task_id", "token"):
        runs[task_id].append(token)
    assert set(runs) == set(ids)
    assert not {task_id: tokens for task_id, tokens in runs.items() if len(tokens) != len(set(tokens))}
    final = dict(Task.objects.filter(pk__in=ids).values_list("pk", "token"))
    assert all(final[task_id] in runs[task_id] for task_id in ids)
    # The recovery controller and the scheduler led through the pooler too.
    assert Lease.objects.filter(resource=RECOVERY_LEASE).exists()
    assert ScheduleRun.objects.filter(schedule="tick").exists()

    print(dashboard_through(bouncer_pool_of_4.url(dbname)))
    for proc in workers.procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for name, proc in workers.procs.items():
        assert proc.wait(30) in (0, -signal.SIGKILL), f"{name}:\n{workers.log(name)[-5000:]}"

    # A server connection the pooler closed (its client killed mid-transaction) may still be on its
    # way out, and the pooler opens another only when a client waits: the pool settles at its size
    # or below it.
    def settled() -> set[int] | None:
        pids = server_pids() - ours
        return pids if 0 < len(pids) <= bouncer_pool_of_4.pool_size else None

    pool = wait_until(settled, 30, what=f"a pool of at most {bouncer_pool_of_4.pool_size} server connections")
    read = settings_of_every_server_connection(bouncer_pool_of_4, dbname)
    # The read held as many clients as the pool has room for at once, so it was handed every server
    # connection the drain left (and new ones up to the pool's size): each of those still open was read.
    assert len(read) == bouncer_pool_of_4.pool_size
    assert pool & (server_pids() - ours) <= set(read)
    with connection.cursor() as cursor:
        cursor.execute("SELECT reset_val FROM pg_settings WHERE name IN ('lock_timeout', 'statement_timeout')")
        defaults = {row[0] for row in cursor.fetchall()}
    assert defaults == {"0"}
    assert read == dict.fromkeys(read, ("0", "0"))
