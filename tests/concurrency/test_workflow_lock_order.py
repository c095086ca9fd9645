"""Lock-order cycles between a workflow's row and its members' rows.

Every finishing statement locks the member row first (its own UPDATE) and the workflow row last (its
trigger). Two product statements take them the other way round: ``Workflow.cancel`` marks the
workflow CANCELLED (locking its row) and only then updates the members; retention's
PRUNE_WORKFLOWS_SQL locks the workflow (``picked``) and then its members (``FOR UPDATE OF t``,
without the SKIP LOCKED its comment promises). A member finishing (or reopening) in between closes
the cycle, and PostgreSQL aborts one side with "deadlock detected".

The interleaving is made certain, not hoped for: a third session holds a lock on one member, so the
operator's (or retention's) statement stops on it holding the workflow row, and the other statement
is started only once it waits; every step is polled on pg_stat_activity with a deadline.

Found by breaker 23 (the bug hunt on issue 23: workflows)."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connection, connections

from tasks.maintenance import retention
from tasks.models import Task, Workflow
from tasks.workflows import Workflow as Flow
from tasks.workflows import group, step
from tests import helpers
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def waiting_on_locks() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


def in_thread(name: str, found: dict[str, Any], work: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        try:
            found[name] = work()
        except Exception as exc:  # the test reports what each side raised
            found[name] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def lock_rows(ids: list[int]) -> psycopg.Connection[Any]:
    """A session holding FOR SHARE locks on ``ids`` until it is closed (or commits)."""
    holder = psycopg.connect(helpers.test_database_url())
    holder.execute("SELECT id FROM tasks_task WHERE id = ANY(%s) FOR SHARE", [ids]).fetchall()
    return holder


def test_cancelling_a_workflow_while_a_member_finishes_does_not_deadlock() -> None:
    flow = Flow("race")
    flow.add(step(NOOP))
    flow.add(step(NOOP))
    done = flow.enqueue()
    running, ready = done.task_ids
    (claimed,) = Task.objects.claim("w1", limit=1)
    assert claimed.id == running
    holder = lock_rows([ready])
    found: dict[str, Any] = {}
    try:
        # The operator's cancel: marks the workflow (its row locked), then stops on the READY member.
        cancel = in_thread("cancel", found, lambda: Workflow.objects.filter(pk=done.id).cancel())
        wait_until(lambda: waiting_on_locks() == 1, 30, what="the cancel to wait for the held member")
        # The worker finishes the running member: its row locked, its trigger waits for the workflow row.
        finish = in_thread(
            "finish", found, lambda: Task.objects.complete_many("w1", [(claimed.id, claimed.token, "null")])
        )
        wait_until(lambda: waiting_on_locks() == 2, 30, what="the finish to wait for the workflow row")
    finally:
        holder.close()  # the cancel goes on to the running member, held by the finish
    cancel.join(60)
    finish.join(60)
    assert not isinstance(found["cancel"], Exception), found
    assert not isinstance(found["finish"], Exception), found
    row = Workflow.objects.get(pk=done.id)
    assert (row.status, row.remaining) == ("CANCELLED", 0)


def test_retention_pruning_a_workflow_while_an_operator_requeues_a_member_does_not_deadlock() -> None:
    # Fixed by taking the locks in the finishing statements' order: the prune takes members first
    # (SKIP LOCKED) and a workflow only once it holds every member, so a requeue in progress (its
    # member row held, the workflow row next, through its trigger) makes the prune pass the
    # workflow over instead of waiting for it, and nothing waits in a cycle.
    done = group([step(NOOP), step(NOOP), step(NOOP)]).enqueue()
    while claimed := Task.objects.claim("w1", limit=10):
        Task.objects.complete_many("w1", [(t.id, t.token, "null") for t in claimed])
    long_ago = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    Task.objects.filter(workflow_id=done.id).update(finished_at=long_ago)
    Workflow.objects.filter(pk=done.id).update(finished_at=long_ago)
    assert Workflow.objects.get(pk=done.id).status == "SUCCESSFUL"
    middle = done.task_ids[1]
    holder = lock_rows([middle])  # as a requeue of it that has not reached the workflow row yet
    try:
        pruned = retention.prune({"SUCCESSFUL": dt.timedelta(days=1)})
        assert pruned == {"SUCCESSFUL": 0}  # passed over, not waited for
        assert waiting_on_locks() == 0
    finally:
        holder.close()
    found: dict[str, Any] = {}
    requeue = in_thread("requeue", found, lambda: Task.objects.filter(pk=middle).requeue())
    prune = in_thread("prune", found, lambda: retention.prune({"SUCCESSFUL": dt.timedelta(days=1)}))
    prune.join(60)
    requeue.join(60)
    assert not isinstance(found["prune"], Exception), found
    assert not isinstance(found["requeue"], Exception), found
    members = Task.objects.filter(workflow_id=done.id).count()
    if found["requeue"] == 1:  # the requeue went first: the workflow is running again, whole
        assert members == 3 and Workflow.objects.get(pk=done.id).status == "RUNNING"
    else:  # the prune went first: the unit is gone, the requeue found nothing
        assert found["requeue"] == 0 and members == 0 and not Workflow.objects.filter(pk=done.id).exists()
