"""``Task.objects.wait`` (what a django.tasks result's ``wait()`` runs) and ``Task.objects.await_``
(``await_()``'s, on an event loop) through a real PgBouncer in transaction pooling with two server
connections, declared (``DATABASE_POOLED=true``) and undeclared (the pooler found by the backend
pid): 24 waiters at once in another process (threads, or coroutines on one loop), on a task a worker
finishes, one an operator cancels while it waits, one cancelled while it runs, and one nobody runs
that they wait for with a timeout. Each waiter returns its task's final status (or times out and
leaves the task as it was), and no server connection of the pool is left LISTENing: a LISTEN
through the pooler would stay on a server session the next client is handed (invariant 13)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import psycopg
import pytest
from django.db import connection

from tasks.models import Task, TaskStatus
from tasks.testing import run_until_empty
from tests.helpers import ROOT, child_env, wait_until
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.task_paths import NOOP
from tests.helpers.zygote import popen_python

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PER_TASK = 6
WAITERS = r"""
import json, sys, threading, time
import django
django.setup()
from django.db import connections
from tasks.models import Task

plan = json.loads(sys.argv[1])  # [[task_id, timeout], ...]
out = threading.Lock()

def wait(task_id, timeout):
    began = time.monotonic()
    try:
        row = Task.objects.wait(task_id, timeout=timeout, poll=0.2)
        outcome = row.status
    except Exception as exc:
        outcome = type(exc).__name__
    finally:
        connections.close_all()
    with out:
        print(json.dumps({"task": task_id, "outcome": outcome, "seconds": time.monotonic() - began}), flush=True)

threads = [threading.Thread(target=wait, args=(t, s)) for t, s in plan]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""
AWAITERS = r"""
import asyncio, json, sys, time
import django
django.setup()
from tasks.models import Task

plan = json.loads(sys.argv[1])  # [[task_id, timeout], ...]

async def wait(task_id, timeout):
    began = time.monotonic()
    try:
        row = await Task.objects.await_(task_id, timeout=timeout, poll=0.2)
        outcome = row.status
    except Exception as exc:
        outcome = type(exc).__name__
    print(json.dumps({"task": task_id, "outcome": outcome, "seconds": time.monotonic() - began}), flush=True)

async def main():
    await asyncio.gather(*(wait(t, s) for t, s in plan))

asyncio.run(main())
"""


def listening_server_sessions(bouncer: Bouncer, dbname: str) -> dict[int, int]:
    """Every server connection of the pool (one client per connection, each inside a transaction, so
    each holds its own while the others ask): backend pid -> channels it LISTENs on."""
    clients = [psycopg.connect(bouncer.conninfo(dbname)) for _ in range(bouncer.pool_size)]
    try:
        found = {}
        for client in clients:
            row = client.execute("SELECT pg_backend_pid(), (SELECT count(*) FROM pg_listening_channels())").fetchone()
            assert row is not None
            found[row[0]] = row[1]
        return found
    finally:
        for client in clients:
            client.rollback()
            client.close()


@pytest.mark.parametrize("script", [WAITERS, AWAITERS], ids=["threads", "event-loop"])
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_many_waiters_through_the_pooler_poll_and_end_at_each_final_status(
    bouncer_pool_of_2: Bouncer, declared: bool, script: str
) -> None:
    dbname = connection.settings_dict["NAME"]
    finished, cancelled, running, untouched = (Task.objects.enqueue(NOOP, queue=q).id for q in ("wa", "wb", "wc", "wd"))
    before = Task.objects.filter(pk=untouched).values().get()
    plan = [[t, 60.0] for t in (finished, cancelled, running) for _ in range(PER_TASK)]
    plan += [[untouched, 1.0]] * PER_TASK
    env = child_env(DATABASE_URL=bouncer_pool_of_2.url(dbname), DATABASE_POOLED="true" if declared else "false")
    env.pop("DIRECT_DATABASE_URL", None)
    child = popen_python(
        ["-c", script, json.dumps(plan)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ids = [finished, cancelled, running, untouched]
        wait_until(
            lambda: Task.objects.filter(pk__in=ids, finish_waited=True).count() == 4, 60, what="every task waited for"
        )
        (claimed,) = Task.objects.claim("test-worker", queues=["wc"])
        assert claimed.id == running
        assert Task.objects.filter(pk=cancelled).cancel() == 1
        assert Task.objects.filter(pk=running).cancel() == 1  # its worker loses it
        run_until_empty(["wa"])
        stdout, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    assert child.returncode == 0, stderr
    outcomes: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        result: dict[str, Any] = json.loads(line)
        outcomes.setdefault(result["task"], []).append(result["outcome"])
    assert outcomes == {
        finished: [TaskStatus.SUCCESSFUL] * PER_TASK,
        cancelled: [TaskStatus.CANCELLED] * PER_TASK,
        running: [TaskStatus.CANCELLED] * PER_TASK,
        untouched: ["TaskWaitTimeout"] * PER_TASK,
    }, stderr
    # The timed-out waits left their task as it was (only marked as waited for).
    after = Task.objects.filter(pk=untouched).values().get()
    assert {k: v for k, v in after.items() if k != "finish_waited"} == {
        k: v for k, v in before.items() if k != "finish_waited"
    }
    assert after["status"] == TaskStatus.READY
    sessions = listening_server_sessions(bouncer_pool_of_2, dbname)
    assert len(sessions) == bouncer_pool_of_2.pool_size
    assert not any(sessions.values()), f"a server connection of the pool was left LISTENing: {sessions}"
