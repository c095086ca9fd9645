"""Workers and leases through a real PgBouncer with a pool of ONE server connection: every client's
transactions take turns on the same server session.

Found by a bug hunt (breaker) on issue 19: running behind PgBouncer."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from tasks.models import Task, TaskStatus
from tests.helpers import ROOT, child_env, wait_until
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.workers import Workers
from tests.helpers.zygote import run_python

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def pooled_url(bouncer: Bouncer) -> str:
    return bouncer.url(connection.settings_dict["NAME"])


def server_timeouts(bouncer: Bouncer) -> tuple[str, str]:
    with psycopg.connect(bouncer.conninfo(connection.settings_dict["NAME"])) as client:
        row = client.execute("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')").fetchone()
        assert row is not None
        return row[0], row[1]


def test_handlers_never_see_the_workers_bounds_through_a_pool_of_one(
    bouncer_pool_of_1: Bouncer, workers: Workers
) -> None:
    """The worker's claims, heartbeats, outcome writes and its leaders' lease heartbeats (recovery,
    scheduler) share one server session with sync and async handlers; no handler statement ever runs
    under the worker's statement or lock timeout, and none is left on the session afterwards."""
    sync = Task.objects.bulk_enqueue("tests.testapp.handlers.breaker_timeouts_seen", [{"n": n} for n in range(40)])
    aio = Task.objects.bulk_enqueue("tests.testapp.handlers.breaker_async_timeouts_seen", [{"n": n} for n in range(40)])
    proc = workers.start(
        "pool1",
        "--concurrency",
        "3",
        "--async-concurrency",
        "4",
        DATABASE_URL=pooled_url(bouncer_pool_of_1),
        DATABASE_POOLED="true",
    )
    ids = sync + aio

    def done() -> int:
        return Task.objects.filter(pk__in=ids, status__in=[TaskStatus.SUCCESSFUL, TaskStatus.FAILED]).count()

    wait_until(lambda: done() == len(ids), 120, what="every task to finish")
    assert Task.objects.filter(pk__in=ids).exclude(status=TaskStatus.SUCCESSFUL).count() == 0
    results: dict[int, Any] = dict(Task.objects.filter(pk__in=ids).values_list("pk", "return_value"))
    assert {tuple(results[pk]) for pk in sync} == {("0", "0")}
    assert {tuple(map(tuple, results[pk])) for pk in aio} == {(("0", "0"), ("0", "0"))}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, workers.log("pool1")[-5000:]
    assert server_timeouts(bouncer_pool_of_1) == ("0", "0")


def test_a_handler_leaking_session_timeouts_does_not_break_the_worker(
    bouncer_pool_of_1: Bouncer, workers: Workers
) -> None:
    """Task code sets ``statement_timeout = 1ms`` and ``lock_timeout = 1ms`` on its session, which
    behind a pool of one is everybody's session. The worker's own statements carry their own bounds,
    so it goes on claiming, renewing and recording: every other task succeeds and the worker stops
    cleanly. (The claims, heartbeats and outcome writes hold; the recovery rounds do not, see below.)"""
    poison = Task.objects.bulk_enqueue("tests.testapp.handlers.breaker_poison_session", [{"n": n} for n in range(5)])
    rest = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{"n": n} for n in range(300)])
    proc = workers.start(
        "poisoned", "--concurrency", "2", DATABASE_URL=pooled_url(bouncer_pool_of_1), DATABASE_POOLED="true"
    )
    ids = poison + rest

    def done() -> int:
        return Task.objects.filter(pk__in=ids, status__in=[TaskStatus.SUCCESSFUL, TaskStatus.FAILED]).count()

    wait_until(lambda: done() == len(ids), 120, what="every task to finish")
    assert Task.objects.filter(pk__in=ids).exclude(status=TaskStatus.SUCCESSFUL).count() == 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, workers.log("poisoned")[-5000:]
    # Not held, and not asserted: the recovery controller's rounds (and retention) run unbounded, so
    # they run under the leaked 1 ms ("recovery round failed: canceling statement due to statement
    # timeout") for as long as the poisoned server session lives.


LEASE_SCRIPT = """
import django
django.setup()
from leasing.holder import lease
from leasing.models import Lease
from tests.helpers import ROOT, child_env, wait_until

# A plain lease and two semaphore slots, each renewed several times by its heartbeat, through a
# pool of one; then each released.
with lease("breaker:plain", ttl=0.6) as plain, lease("breaker:sem", ttl=0.6, limit=2) as one, lease(
    "breaker:sem", ttl=0.6, limit=2
) as two:
    resources = [plain.grant.resource, one.grant.resource, two.grant.resource]
    wait_until(
        lambda: all(
            Lease.objects.get(resource=resource).renewals >= 5 for resource in resources
        ),
        30,
        what="five renewals of every lease",
    )
    assert not (plain.lost or one.lost or two.lost)
print("held", sorted(resources))
"""


def test_lease_heartbeats_through_a_pool_of_one_leave_no_session_state(bouncer_pool_of_1: Bouncer) -> None:
    """Lease heartbeats (a plain lease and two slots of a semaphore) renew through a pool of one
    server connection, which the test's own reads share; the session keeps the server's defaults."""
    done = run_python(
        ["-c", LEASE_SCRIPT],
        cwd=ROOT,
        env=child_env(DATABASE_URL=pooled_url(bouncer_pool_of_1), DATABASE_POOLED="true"),
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "held" in done.stdout
    assert server_timeouts(bouncer_pool_of_1) == ("0", "0")


def pgbouncer_pid(bouncer: Bouncer) -> int:
    """The pid of the fixture's own PgBouncer: the process whose command line names its config file."""
    config = str(bouncer.log.parent / "pgbouncer.ini")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if config.encode() in argv:
                return int(entry.name)
    raise AssertionError(f"no process runs {config}")


def test_a_drain_wedged_on_a_frozen_pooler_ends_in_the_hard_exit(bouncer_pool_of_1: Bouncer, workers: Workers) -> None:
    """The pooler freezes (SIGSTOP): every statement waits on a socket that never answers, where no
    statement timeout reaches (the server never got the statement). A SIGTERMed ``manage.py
    run_worker`` cannot finish its drain; as the process's main program it exits anyway (code 70)
    after its grace, two TTLs and 5 s, and says why."""
    proc = workers.start(
        "frozen", "--shutdown-grace", "1", DATABASE_URL=pooled_url(bouncer_pool_of_1), DATABASE_POOLED="true"
    )
    wait_until(lambda: " started: " in workers.log("frozen"), 30, what="the worker's start line")
    pid = pgbouncer_pid(bouncer_pool_of_1)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # Ended while the pooler is still frozen: by its own hard exit, nothing thawed it.
        wait_until(lambda: proc.poll() is not None, 120, what="the hard exit")  # grace 1 + 2 * ttl 2 + 5 = 10 s
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert proc.returncode == 70, workers.log("frozen")[-5000:]
    assert "still running" in workers.log("frozen") and "exiting now" in workers.log("frozen")
    assert took >= 10, took  # its grace and two TTLs were waited out first (how much longer: the machine's load)
