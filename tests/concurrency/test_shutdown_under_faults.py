"""Stopping the worker under faults: a stop while the database is
unreachable, a stop while the listener reconnects, a mixed sync/async fleet through PgBouncer
stopped twice and SIGKILLed, and ``run_worker`` called in-process again and again.

Found by breaker 21 (the bug hunt on issue 21: the worker rebuilt from small parts). These attacks held."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection
from django.db.models.functions import Now

from tasks.models import Task, TaskStatus
from tests.helpers import test_database_url as database_url
from tests.helpers import wait_until, worker_row
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.pgproxy import PgProxy
from tests.helpers.workers import STOP_WITHIN, Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."
#: The cut worker's lease: far longer than its grace (2 s) and a retry round.
LONG_TTL = 60


def cut_off_while_running(proxy: PgProxy, workers: Workers, name: str, *, seconds: float) -> tuple[list[int], Any]:
    """A worker (grace 2 s, TTL ``LONG_TTL``) running two tasks of ``seconds``, then cut off from the
    database: every connection cut, every new one refused. The task ids and the process."""
    ids = [Task.objects.enqueue(H + "work", kwargs={"seconds": seconds}).id for _ in range(2)]
    proc = workers.start(
        name,
        "--concurrency",
        "2",
        "--shutdown-grace",
        "2",
        "--ttl",
        str(LONG_TTL),
        DATABASE_URL=proxy.url_for(database_url()),
    )
    wait_until(lambda: Task.objects.filter(pk__in=ids, attempt_started=True).count() == 2, 60, what="both started")
    proxy.stop()
    return ids, proc


def leases_live(ids: list[int]) -> int:
    """How many of ``ids`` still run under a live lease, on the database's clock."""
    return Task.objects.filter(pk__in=ids, status=TaskStatus.RUNNING, expires_at__gt=Now()).count()


def test_sigterm_while_the_database_is_unreachable_exits_within_the_grace(proxy: PgProxy, workers: Workers) -> None:
    """Retries end at the drain deadline once a stop was requested (fault-model.md), whatever part
    (listener, heartbeat, recovery, hand-back) is retrying. The worker's TTL is far longer than its
    grace: a retry loop left to run its own bound (one TTL, from after the cut, so past the last
    renewal) would keep the process alive until its leases expired. It exits before they do, on the
    database's clock."""
    ids, proc = cut_off_while_running(proxy, workers, "cut", seconds=30)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0  # a hang guard, not the claim
    # The claim: it ended while both leases still ran (no hand-back could land, so nothing released
    # them): it waited for the drain deadline, not for a TTL.
    assert leases_live(ids) == 2
    # Its claims lapse (brought forward: the TTL's passing is not this test's) and go to a worker
    # that can reach the database.
    Task.objects.filter(pk__in=ids).update(kwargs={"seconds": 0}, expires_at=Now())
    workers.start("other", "--concurrency", "2")
    wait_until(lambda: Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL).count() == 2, 60, what="rerun")


def test_sigterm_while_the_dispatcher_retries_a_cut_round_exits_within_the_grace(
    proxy: PgProxy, workers: Workers
) -> None:
    """The stop comes while the dispatcher itself retries (a round's finish cut: its reconcile, or a
    claim's lost reply handed back): its drain begins only after that loop, so the loop's bound counts
    from the stop request, not from a drain deadline not set yet (breaker 59: the process ran one TTL
    past the stop, 62 s with a TTL of 60, its leases lapsed)."""
    ids, proc = cut_off_while_running(proxy, workers, "cutround", seconds=2)
    # The attempts end; the round that writes their results meets the cut, and the dispatcher retries.
    wait_until(lambda: "failed (connection)" in workers.log("cutround"), 60, what="the dispatcher to retry")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0  # a hang guard, not the claim
    # The claim: it ended while both leases still ran (renewed last before the cut, for 60 s).
    assert leases_live(ids) == 2


def test_sigterm_while_the_listener_reconnects_ends_at_once(proxy: PgProxy, workers: Workers) -> None:
    """The listener's wait and its reconnect pause end on the stop, not at a poll (here an hour): its
    thread ends by itself, not abandoned at the bound of the worker's join (which would log that
    "the listener service did not stop within 5s")."""
    proc = workers.start("lis", "--poll-interval", "3600", DATABASE_URL=proxy.url_for(database_url()))
    wait_until(lambda: proxy.kill_connections(b"LISTEN") > 0, 60, what="the listener's connection")
    wait_until(lambda: "listener connection failed" in workers.log("lis"), 60, what="the listener to notice")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(STOP_WITHIN) == 0  # a hang guard
    assert worker_row("lis").stopped_at is not None
    assert "service did not stop" not in workers.log("lis"), workers.log("lis")[-5000:]


def test_a_stop_is_acted_on_while_every_statement_waits_at_the_pooler(
    bouncer_pool_of_1: Bouncer, workers: Workers
) -> None:
    """Another client holds the pooler's one server connection in an open transaction: every
    statement of the worker's waits in the pooler's queue, where no statement_timeout runs (the
    server never saw it). The stop request is acted on all the same, while the pooler's one server
    connection is still held (the drain begins and is logged), and after the second one the process
    ends, still under the hold, with the status of a hard exit: nothing could be handed back, its
    claims lapse and are recovered."""
    name = connection.settings_dict["NAME"]
    url = bouncer_pool_of_1.url(name)
    served = Task.objects.enqueue(H + "add", kwargs={"a": 1, "b": 2})
    proc = workers.start(
        "queued", "--concurrency", "1", "--shutdown-grace", "30", DATABASE_URL=url, DATABASE_POOLED="true"
    )
    wait_until(
        lambda: Task.objects.filter(pk=served.id, status=TaskStatus.SUCCESSFUL).exists(), 60, what="a task served"
    )
    with psycopg.connect(url, prepare_threshold=None) as holder:
        holder.execute("SELECT 1")  # its transaction stays open: the pool's one server connection is its
        # The worker's statements queue behind it: its dispatcher polls every 0.2 s (a pooled database
        # has no LISTEN), so its next round waits for a server, as does every later statement of the
        # drain. Not "no client of the worker's idle": a connection whose thread has nothing to send
        # (a recovery controller whose lease lapsed behind the holder) stays idle at the pooler for good,
        # and waiting for it timed out in a clean-clone run (stop 62).
        wait_until(
            lambda: bouncer_pool_of_1.clients(name)[1] > 0, 60, what="the worker's statements to queue at the pooler"
        )
        proc.send_signal(signal.SIGTERM)
        # Both inside the hold (it ends only at the rollback below): the waits are hang guards.
        wait_until(lambda: "draining" in workers.log("queued"), 60, what="the drain to begin")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_WITHIN) == 70  # the hard exit: no statement of its could have ended
        holder.rollback()
    assert "after the second stop request (stuck task code or database): exiting now" in workers.log("queued")


def test_mixed_fleet_through_pgbouncer_stopped_twice_and_killed_loses_and_charges_nothing(
    bouncer_pool_of_3: Bouncer, workers: Workers
) -> None:
    env: dict[str, Any] = {
        "DATABASE_URL": bouncer_pool_of_3.url(connection.settings_dict["NAME"]),
        "DATABASE_POOLED": "true",
    }
    ids = [Task.objects.enqueue(H + "work", kwargs={"seconds": 0.3}).id for _ in range(30)]
    ids += [Task.objects.enqueue(H + "async_sleep", kwargs={"seconds": 0.3}).id for _ in range(30)]
    mixed = ("--async-concurrency", "8", "--concurrency", "2")
    first = workers.start("a", *mixed, "--shutdown-grace", "30", **env)
    second = workers.start("b", *mixed, **env)
    done = Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL)
    wait_until(lambda: done.count() >= 10, 60, what="some tasks done")
    first.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining" in workers.log("a"), 60, what="the drain")
    first.send_signal(signal.SIGTERM)
    second.kill()
    assert first.wait(STOP_WITHIN) == 0  # a hang guard
    third = workers.start("c", *mixed, **env)
    wait_until(lambda: done.count() == 60, 60, what="every task done")
    assert not Task.objects.filter(pk__in=ids).exclude(failures=0).exists()
    third.send_signal(signal.SIGTERM)
    assert third.wait(STOP_WITHIN) == 0
    # No session state left on the pooler's server connections (invariant 13): hold all three at once.
    conns = [
        psycopg.connect(bouncer_pool_of_3.url(connection.settings_dict["NAME"]), prepare_threshold=None)
        for _ in range(3)
    ]
    try:
        for conn in conns:
            conn.execute("BEGIN")
        for conn in conns:
            row = conn.execute(
                "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'),"
                " (SELECT count(*) FROM pg_listening_channels()), (SELECT count(*) FROM pg_prepared_statements)"
            ).fetchone()
            assert row == ("0", "0", 0, 0)
    finally:
        for conn in conns:
            conn.close()


def test_run_worker_in_process_again_and_again_leaks_no_thread_fd_or_connection() -> None:
    def backends() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'"
            )
            return int(cursor.fetchone()[0])

    def worker_threads() -> list[str]:
        ours = ("executor-", "heartbeat", "listener", "recovery", "scheduler", "task-signals", "async-")
        return [t.name for t in threading.enumerate() if t.name.startswith(ours)]

    fds: list[int] = []
    for round_number in range(5):
        ids = [Task.objects.enqueue(H + "add", kwargs={"a": round_number, "b": i}).id for i in range(3)]
        call_command(
            "run_worker", "--max-tasks", "3", "--poll-interval", "0.05", "--recovery-interval", "0.05", "-v", "0"
        )
        assert Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL).count() == 3
        wait_until(lambda: not worker_threads(), 60, what="the worker's threads to end")
        wait_until(lambda: backends() == 0, 60, what="the worker's connections to close")
        fds.append(len(os.listdir("/proc/self/fd")))
    assert len(set(fds)) == 1, fds  # the listener's stop pipe and connections are closed every time
