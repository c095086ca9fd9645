"""A depends_on joining a callback_only group while its members finish on other
connections (threads, each its own PostgreSQL connection).

Found by breaker 31 (the bug hunt on the workflow settle fast path and callback_only groups)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections, transaction

from tasks.models import Task
from tasks.models import Workflow as WorkflowRow
from tasks.workflows import group, step
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def lock_waiters() -> int:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # a transaction keeps its first view otherwise
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND"
            " wait_event_type = 'Lock' AND datname = current_database()"
        )
        return int(cursor.fetchone()[0])


def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:
            out["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.mark.parametrize("rounds", [5])
def test_a_member_finishing_while_a_dependant_joins_releases_the_dependant(rounds: int) -> None:
    for _ in range(rounds):
        done = group([step(NOOP) for _ in range(3)], then=step(NOOP)).enqueue()
        m0, m1, m2 = done.task_ids[:3]
        claimed = {t.id: t for t in Task.objects.claim("w1", limit=10)}
        # The joiner holds its lock on m0 (its transaction open) while m0 and m1 finish elsewhere.
        with transaction.atomic():
            late = Task.objects.enqueue(NOOP, depends_on=[m0])
            fin0, out0 = in_thread(Task.objects.complete_many, "w1", [(m0, claimed[m0].token, "null")])
            fin1, out1 = in_thread(Task.objects.complete_many, "w1", [(m1, claimed[m1].token, "null")])
            # m1's finish waits too: its settle counts on the workflow row the join updated.
            wait_until(lambda: lock_waiters() >= 2, what="both finishes wait for the joiner")
        fin0.join(30)
        fin1.join(30)
        assert not fin0.is_alive() and not fin1.is_alive()
        assert "error" not in out0 and "error" not in out1, (out0, out1)
        assert Task.objects.get(pk=late.id).status == "READY"
        assert WorkflowRow.objects.get(pk=done.id).callback_waiting == 1
        Task.objects.complete_many("w1", [(m2, claimed[m2].token, "null")])
        assert Task.objects.get(pk=done.callback_id).status == "READY"
        Task.objects.all().delete()


def test_a_dependant_joining_while_its_parent_finishes_uncommitted_sees_it_final() -> None:
    done = group([step(NOOP) for _ in range(2)], then=step(NOOP)).enqueue()
    m0, m1 = done.task_ids[:2]
    claimed = {t.id: t for t in Task.objects.claim("w1", limit=10)}
    finished, go = threading.Event(), threading.Event()

    def finish_and_hold() -> None:
        with transaction.atomic():
            Task.objects.complete_many("w1", [(m0, claimed[m0].token, "null")])
            finished.set()
            go.wait(30)

    holder, out = in_thread(finish_and_hold)
    assert finished.wait(30)
    joiner, joined = in_thread(lambda: Task.objects.enqueue(NOOP, depends_on=[m0]))
    wait_until(lambda: lock_waiters() >= 1, what="the joiner waits for m0's finish")
    go.set()
    holder.join(30)
    joiner.join(30)
    assert "error" not in out and "error" not in joined, (out, joined)
    assert Task.objects.get(pk=joined["value"].id).status == "READY"
    Task.objects.complete_many("w1", [(m1, claimed[m1].token, "null")])
    assert Task.objects.get(pk=done.callback_id).status == "READY"
    row = WorkflowRow.objects.get(pk=done.id)
    assert (row.callback_waiting, row.remaining) == (0, 2)
