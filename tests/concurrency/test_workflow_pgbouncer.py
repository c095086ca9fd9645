"""Workflows through a real PgBouncer in transaction pooling: enqueued through the pooler (the
builder's statements unprepared there), drained by workers polling through it, one of them
SIGKILLed. The callback runs once after its members, the chain in order, and no server connection
of the pool is left with the trigger's flag or a timeout set."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.db.models import Min

from tasks.models import Task, Workflow
from tests.helpers import ROOT, child_env, wait_until
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.workers import Workers
from tests.helpers.zygote import run_python
from tests.testapp.models import Effect, Once

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.workflow_handlers."

ENQUEUE = """
import json, django
django.setup()
from django.db import connection
from tasks.workflows import chain, group, step
H = "tests.testapp.workflow_handlers."
members = [step(H + "member", n=n, seed=3, fail_every=0, flaky=0.1, work=0.02) for n in range(300)]
g = group(members, then=step(H + "callback", key="pooled"), on_failure="run").enqueue()
c = chain(*[step(H + "link", i, work=0.01) for i in range(20)]).enqueue()
print(json.dumps({"group": g.id, "callback": g.callback_id, "chain": c.id, "steps": c.task_ids,
                  "pooled": connection.settings_dict.get("OPTIONS", {}).get("prepare_threshold", "set")}))
"""


def test_workflows_through_pgbouncer_with_a_kill(bouncer_pool_of_3: Bouncer, workers: Workers) -> None:
    dbname = connection.settings_dict["NAME"]
    pooled: dict[str, Any] = {"DATABASE_URL": bouncer_pool_of_3.url(dbname), "DATABASE_POOLED": "true"}
    done = run_python(
        ["-c", ENQUEUE],
        cwd=ROOT,
        env=child_env(**pooled),
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    made = json.loads(done.stdout.strip().splitlines()[-1])
    workers.start("pw-0", "--concurrency", "4", **pooled)
    workers.start("pw-1", "--concurrency", "4", **pooled)
    wait_until(lambda: Effect.objects.filter(phase="ended").count() >= 50, 60, what="progress before the kill")
    os.kill(workers.procs["pw-0"].pid, signal.SIGKILL)
    workers.procs["pw-0"].wait(30)
    workers.start("pw-2", "--concurrency", "4", **pooled)

    def ended() -> bool:
        return not Workflow.objects.filter(pk__in=[made["group"], made["chain"]], status="RUNNING").exists()

    wait_until(ended, 180, what="both workflows to end")
    group_row = Workflow.objects.get(pk=made["group"])
    members = Task.objects.filter(workflow_id=made["group"]).exclude(pk=made["callback"])
    assert group_row.remaining == 0 and members.count() == 300
    callback = Task.objects.get(pk=made["callback"])
    assert callback.status == "SUCCESSFUL"
    (once,) = Once.objects.filter(key="pooled")
    assert sum(once.value.values()) == 300
    last_member = max(t for t in members.values_list("finished_at", flat=True) if t)
    first_start = Effect.objects.filter(task_id=callback.id).aggregate(first=Min("created_at"))["first"]
    assert first_start is not None and first_start > last_member
    steps = list(Task.objects.filter(pk__in=made["steps"]).order_by("id"))
    assert [t.status for t in steps] == ["SUCCESSFUL"] * 20
    assert [t.return_value for t in steps] == list(range(20))
    assert Workflow.objects.get(pk=made["chain"]).status == "SUCCESSFUL"

    for proc in workers.procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in workers.procs.values():
        proc.wait(30)
    # Every server connection of the pool, each held in a transaction of its own while read.
    clients = [psycopg.connect(bouncer_pool_of_3.conninfo(dbname)) for _ in range(bouncer_pool_of_3.pool_size)]
    try:
        seen = {}
        for client in clients:
            row = client.execute(
                "SELECT pg_backend_pid(), COALESCE(current_setting('leasing.workflow_settle', true), ''),"
                " current_setting('statement_timeout'), current_setting('lock_timeout')"
            ).fetchone()
            assert row is not None
            seen[row[0]] = row[1:]
    finally:
        for client in clients:
            client.rollback()
            client.close()
    assert set(seen.values()) == {("", "0", "0")}, seen
