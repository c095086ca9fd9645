"""Attacks on the requeue's settle of migration 0038 (issue 56): requeues of several members across
workflows in one statement, chains with on_failure="run" behind the cancelled one, group callbacks, the
transaction-local setting on a reused connection, and a requeue racing a bulk retry on two connections.
After each step every workflow's counts equal a recount from its members, and the repair sweep finds
nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction

from tasks.maintenance.bulk import BulkRunner
from tasks.maintenance.repair import repair_stranded
from tasks.models import BulkOperation, Repair, Task
from tasks.models import Workflow as WorkflowRow
from tasks.workflows import Workflow, chain, group, step
from tests.db.test_workflow_dependant_cancelled_again import held_open, waiting_for_it
from tests.db.test_workflow_settle_races import claim_one, run_all, state
from tests.helpers.connections import waits_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)

NOOP = "tests.testapp.handlers.noop"
ECHO = "tests.testapp.handlers.echo"
FINAL = ("SUCCESSFUL", "FAILED", "CANCELLED")


def recount(flow: int) -> tuple[int, int]:
    members = list(Task.objects.filter(workflow_id=flow).values_list("status", flat=True))
    return sum(s not in FINAL for s in members), sum(s in ("FAILED", "CANCELLED") for s in members)


def assert_counted(*flows: int) -> None:
    for flow in flows:
        row = WorkflowRow.objects.get(pk=flow)
        unfinished, bad = recount(flow)
        assert (row.remaining, row.failed) == (unfinished, bad), (flow, row.status, row.remaining, row.failed)
        if row.status != "CANCELLED":
            expected = "RUNNING" if unfinished else ("FAILED" if bad else "SUCCESSFUL")
            assert row.status == expected, (flow, row.status, unfinished, bad)
        assert (row.finished_at is None) == (unfinished > 0) or row.status == "CANCELLED"
    assert repair_stranded().empty, "the repair sweep found something to set right"
    assert not Repair.objects.exists()


def cancelled_chain(length: int = 2, on_failure: str = "cancel") -> tuple[int, list[int]]:
    flow = Workflow()
    prev: list[int] = []
    for _ in range(length):
        prev = [flow.add(step(NOOP), after=prev, on_failure=on_failure)]
    done = flow.enqueue()
    claim_one(done.task_ids[0])
    assert Task.objects.filter(pk=done.task_ids[0]).cancel() == 1
    return done.id, list(done.task_ids)


def succeeded_chain(length: int = 2) -> tuple[int, list[int]]:
    done = chain(*(step(NOOP) for _ in range(length)), pipe=False).enqueue()
    run_all()
    return done.id, list(done.task_ids)


def test_one_requeue_across_three_workflows_each_counted() -> None:
    f1, (_a1, b1) = cancelled_chain()
    f2, (_a2, b2, c2) = cancelled_chain(3)
    f3, (_a3, b3) = succeeded_chain()
    assert_counted(f1, f2, f3)
    assert Task.objects.filter(pk__in=[b1, b2, c2, b3]).requeue() == 4
    assert state(b1, b2, c2) == [("CANCELLED", 0)] * 3
    assert state(b3)[0][0] == "READY"
    assert_counted(f1, f2, f3)
    run_all()
    assert_counted(f1, f2, f3)
    assert WorkflowRow.objects.get(pk=f3).status == "SUCCESSFUL"


def test_requeue_of_parent_and_dependants_together_in_two_workflows() -> None:
    f1, (a1, b1, c1) = cancelled_chain(3)
    f2, (_a2, b2) = cancelled_chain()
    # a1 reopened with its dependants (they wait for it), b2 alone (cancelled again).
    assert Task.objects.filter(pk__in=[a1, b1, c1, b2]).requeue() == 4
    assert [s for s, _ in state(a1, b1, c1, b2)] == ["READY", "AWAITING", "AWAITING", "CANCELLED"]
    assert_counted(f1, f2)
    run_all()
    assert_counted(f1, f2)
    assert WorkflowRow.objects.get(pk=f1).status == "SUCCESSFUL"


@pytest.mark.parametrize("length", [3, 4])
def test_a_chain_that_runs_on_failure_behind_a_requeued_member(length: int) -> None:
    """on_failure="run" down the chain: the cancelled parent's dependant ran; requeued together with its
    own dependants, the counts stay a recount at each step."""
    flow, ids = cancelled_chain(length, on_failure="run")
    run_all()
    assert_counted(flow)
    assert Task.objects.filter(pk__in=ids[1:]).requeue() == length - 1
    assert_counted(flow)
    run_all()
    assert_counted(flow)
    assert WorkflowRow.objects.get(pk=flow).status == "FAILED"


def test_mixed_edges_requeue_of_the_middle_member() -> None:
    """A -cancel-> B -run-> C -cancel-> D: A cancelled, B cancelled, C ran, D ran. B requeued alone:
    cancelled again; C (READY or done) as it was."""
    flow = Workflow()
    a = flow.add(step(NOOP))
    b = flow.add(step(NOOP), after=[a])
    c = flow.add(step(NOOP), after=[b], on_failure="run")
    d = flow.add(step(NOOP), after=[c])
    done = flow.enqueue()
    ids = done.task_ids
    claim_one(ids[a])
    assert Task.objects.filter(pk=ids[a]).cancel() == 1
    assert_counted(done.id)
    # C is READY (released by B's cancel, on_failure run), not run yet: B's requeue holds it back.
    assert Task.objects.filter(pk=ids[b]).requeue() == 1
    assert_counted(done.id)
    run_all()
    assert_counted(done.id)
    assert Task.objects.filter(pk__in=[ids[b], ids[c], ids[d]]).requeue() == 3
    assert_counted(done.id)
    run_all()
    assert_counted(done.id)


@pytest.mark.parametrize("fail_member", [True, False])
def test_group_callback_requeued_with_and_without_its_members(fail_member: bool) -> None:
    done = group([step(NOOP), step(NOOP)], then=step(ECHO)).enqueue()
    flow, (m1, m2, cb) = done.id, done.task_ids
    if fail_member:
        assert Task.objects.filter(pk=m1).cancel() == 1
    run_all()
    assert_counted(flow)
    assert Task.objects.filter(pk=cb).requeue() == 1
    assert_counted(flow)
    assert Task.objects.filter(pk__in=[m1, cb]).requeue() == (2 if fail_member else 1)
    assert_counted(flow)
    run_all()
    assert_counted(flow)
    assert Task.objects.filter(pk__in=[m2, cb]).requeue() >= 1
    assert_counted(flow)
    run_all()
    assert_counted(flow)


def test_the_setting_does_not_outlive_its_statement_or_transaction() -> None:
    f1, (_a1, b1) = cancelled_chain()
    f2, (_a2, b2) = succeeded_chain()
    with transaction.atomic():
        assert Task.objects.filter(pk=b1).requeue() == 1
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('leasing.workflow_reopened', true)")
            assert cursor.fetchone()[0] in (None, "")
        # The same transaction goes on with a member the setting named counted as usual.
        assert Task.objects.filter(pk=b2).requeue() == 1
    assert_counted(f1, f2)
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('leasing.workflow_reopened', true)")
        assert cursor.fetchone()[0] in (None, "")
        cursor.execute("SELECT current_setting('leasing.workflow_settle', true)")
        assert cursor.fetchone()[0] in (None, "", "0")


def test_a_requeue_refused_by_its_key_inside_a_transaction_leaves_counts_right() -> None:
    f1, (a1, b1) = cancelled_chain()
    with transaction.atomic():
        assert Task.objects.filter(pk=b1).requeue() == 1
        assert Task.objects.filter(pk=a1).requeue() == 1
        assert state(a1, b1)[1][0] == "CANCELLED"
    assert_counted(f1)
    assert Task.objects.filter(pk=b1).requeue() == 1
    assert state(a1, b1)[1][0] == "AWAITING"
    assert_counted(f1)
    run_all()
    assert_counted(f1)


def bulk_retry(path: str) -> int:
    BulkOperation.objects.request("retry", {"task_path": path})
    return BulkRunner(batch_size=10, span=25).run_until_idle()


@pytest.mark.parametrize("first", ["requeue", "cancel"])
def test_bulk_retry_beside_a_held_requeue_or_cancel(first: str) -> None:
    """chain(A, B, C) of ECHO dependants that ran; A rerun and running. One connection holds a requeue of
    C (or the cancel of A) open; the bulk retry of every ECHO member comes on the other."""
    done = chain(step(NOOP), step(ECHO), step(ECHO), pipe=False).enqueue()
    run_all()
    flow, (a, _b, c) = done.id, done.task_ids
    assert Task.objects.filter(pk=a).requeue() == 1
    claim_one(a)
    requeue_c: Callable[[], Any] = lambda: Task.objects.filter(pk=c).requeue()  # noqa: E731
    cancel_a: Callable[[], Any] = lambda: Task.objects.filter(pk=a).cancel()  # noqa: E731
    action = requeue_c if first == "requeue" else cancel_a
    holder, release = held_open(action)
    other = waiting_for_it(lambda: bulk_retry(ECHO))
    locked = waits_for_a_lock(other.pid)
    release.set()
    assert holder.outcome() == 1
    other.outcome()
    assert locked or not other.is_alive()
    assert_counted(flow)
    if first == "requeue":
        assert Task.objects.filter(pk=a).cancel() == 1
    assert_counted(flow)
    run_all()
    assert_counted(flow)
