"""A dependant requeued while a parent is cancelled or failed (under ``on_failure="cancel"``) is cancelled
again at once (docs/howto/workflows.md), and its workflow stays final: the requeue and the cancel
again count as nothing, or as one more failed member when it had succeeded (issue 56, DESIGN.md
invariant 14). Before, the statement that cancelled it again counted it down first, from a count that
did not have it yet, and the requeue's count-up left the workflow RUNNING with every member final until
the repair sweep ended it. A repair is a bug: each test asserts that the sweep finds nothing.

Every order and way of committing is played: the two actions as two statements, in one transaction,
in two, the requeue of several members at once (a queryset, a bulk retry, the API), and two real
connections, one held inside its transaction at the step that matters, synchronised on what PostgreSQL
shows (a backend waiting for a lock), never on sleeps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import transaction

from tasks.maintenance.bulk import BulkRunner
from tasks.maintenance.repair import repair_stranded
from tasks.models import BulkOperation, Repair, Task
from tasks.models import Workflow as WorkflowRow
from tasks.workflows import chain, step
from tests.db.test_workflow_settle_races import claim_one, run_all, state
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)

NOOP = "tests.testapp.handlers.noop"
ECHO = "tests.testapp.handlers.echo"


def counts(flow: int) -> tuple[str, int, int, int]:
    row = WorkflowRow.objects.get(pk=flow)
    return row.status, row.total, row.remaining, row.failed


def assert_final_with_nothing_to_repair(flow: int, status: str, failed: int) -> None:
    """The workflow is final now, counted right, and the repair sweep finds nothing to set right."""
    row = WorkflowRow.objects.get(pk=flow)
    assert (row.status, row.remaining, row.failed) == (status, 0, failed), counts(flow)
    assert row.finished_at is not None
    assert repair_stranded().empty, "the repair sweep found something to set right"
    assert not Repair.objects.exists()


def requeue(task_id: int) -> int:
    return Task.objects.filter(pk=task_id).requeue()


def cancel(task_id: int) -> int:
    return Task.objects.filter(pk=task_id).cancel()


def a_chain_with_its_parent_running(length: int = 2) -> tuple[int, list[int]]:
    """chain(A, B, ...) enqueued, A claimed (RUNNING), the others AWAITING."""
    done = chain(*(step(NOOP) for _ in range(length)), pipe=False).enqueue()
    claim_one(done.task_ids[0])
    return done.id, list(done.task_ids)


def a_chain_that_ran_with_its_parent_running_again() -> tuple[int, int, int]:
    """chain(A, B) ran (both SUCCESSFUL); A requeued and claimed again (RUNNING): B is SUCCESSFUL
    behind an unfinished parent, so B's requeue may come before or after A's cancel."""
    done = chain(step(NOOP), step(NOOP), pipe=False).enqueue()
    run_all()
    a, b = done.task_ids
    assert requeue(a) == 1
    claim_one(a)
    assert state(a, b) == [("RUNNING", 0), ("SUCCESSFUL", 0)]
    return done.id, a, b


def cancelled_again(task_id: int) -> bool:
    row = Task.objects.get(pk=task_id)
    return row.status == "CANCELLED" and row.errors[-1]["message"].startswith("cancelled again")


# -- one connection -------------------------------------------------------------------------------


def as_two_statements(*actions: Callable[[], Any]) -> None:
    for action in actions:
        action()


def in_one_transaction(*actions: Callable[[], Any]) -> None:
    with transaction.atomic():
        for action in actions:
            action()


def in_two_transactions(*actions: Callable[[], Any]) -> None:
    for action in actions:
        with transaction.atomic():
            action()


COMMITS = pytest.mark.parametrize(
    "commit", [as_two_statements, in_one_transaction, in_two_transactions], ids=lambda f: f.__name__
)


@COMMITS
def test_a_dependant_requeued_after_its_running_parent_was_cancelled_leaves_the_workflow_failed(
    commit: Callable[..., None],
) -> None:
    """The issue's reproduction: chain(A, B), A cancelled while it runs (B cancelled with it), then B
    requeued: B is cancelled again at once, the workflow stays FAILED with nothing remaining."""
    flow, (a, b) = a_chain_with_its_parent_running()
    commit(lambda: cancel(a), lambda: requeue(b))
    assert state(a, b) == [("CANCELLED", 0), ("CANCELLED", 0)]
    assert cancelled_again(b)
    assert_final_with_nothing_to_repair(flow, "FAILED", failed=2)


@COMMITS
def test_a_succeeded_dependant_requeued_after_its_parents_rerun_was_cancelled_counts_one_more_failed(
    commit: Callable[..., None],
) -> None:
    """B had succeeded; A's rerun is cancelled, then B requeued: B is cancelled again, and the workflow
    counts it failed now (2 of 2), FAILED with nothing remaining."""
    flow, a, b = a_chain_that_ran_with_its_parent_running_again()
    commit(lambda: cancel(a), lambda: requeue(b))
    assert state(a, b) == [("CANCELLED", 0), ("CANCELLED", 0)]
    assert cancelled_again(b)
    assert_final_with_nothing_to_repair(flow, "FAILED", failed=2)


@COMMITS
def test_a_dependant_requeued_before_its_parents_rerun_is_cancelled_leaves_the_workflow_failed(
    commit: Callable[..., None],
) -> None:
    """The other order: B requeued while A's rerun runs (B waits for it), then A cancelled (B cancelled
    with it)."""
    flow, a, b = a_chain_that_ran_with_its_parent_running_again()
    commit(lambda: requeue(b), lambda: cancel(a))
    assert state(a, b) == [("CANCELLED", 0), ("CANCELLED", 0)]
    assert_final_with_nothing_to_repair(flow, "FAILED", failed=2)


def test_a_dependant_requeued_in_a_cancelled_workflow_leaves_it_cancelled_as_it_was() -> None:
    """The operator cancelled the whole workflow; a requeue of B, cancelled again at once, changes
    nothing of it: CANCELLED, its end unchanged."""
    flow, (a, b) = a_chain_with_its_parent_running()
    assert WorkflowRow.objects.filter(pk=flow).cancel() == 2
    assert [status for status, _ in state(a, b)] == ["CANCELLED", "CANCELLED"]
    ended = WorkflowRow.objects.get(pk=flow).finished_at
    assert requeue(b) == 1
    assert cancelled_again(b)
    assert_final_with_nothing_to_repair(flow, "CANCELLED", failed=2)
    assert WorkflowRow.objects.get(pk=flow).finished_at == ended


def test_dependants_requeued_together_are_cancelled_again_down_the_chain() -> None:
    """chain(A, B, C), A cancelled (B and C with it), then B and C requeued in one statement: B is
    cancelled again for A, and C (waiting for B again) for B, in the statements the requeue's settle
    runs; each is counted once, by the requeue's."""
    flow, (a, b, c) = a_chain_with_its_parent_running(3)
    assert cancel(a) == 1
    assert Task.objects.filter(pk__in=[b, c]).requeue() == 2
    assert state(a, b, c) == [("CANCELLED", 0), ("CANCELLED", 0), ("CANCELLED", 0)]
    assert_final_with_nothing_to_repair(flow, "FAILED", failed=3)


def test_a_bulk_retry_of_dependants_of_a_cancelled_parent_leaves_the_workflow_failed() -> None:
    """The bulk retry writes the requeue's SET list in its own statement: the same settle counts it."""
    done = chain(step(NOOP), step(ECHO), step(ECHO), pipe=False).enqueue()
    flow, (a, b, c) = done.id, done.task_ids
    claim_one(a)
    assert cancel(a) == 1
    operation = BulkOperation.objects.request("retry", {"task_path": ECHO})
    assert BulkRunner(batch_size=10, span=25).run_until_idle() == 2
    operation.refresh_from_db()
    assert (operation.status, operation.changed) == ("DONE", 2)
    assert state(a, b, c) == [("CANCELLED", 0), ("CANCELLED", 0), ("CANCELLED", 0)]
    assert_final_with_nothing_to_repair(flow, "FAILED", failed=3)


def test_a_dependant_requeued_through_the_api_leaves_the_workflow_failed(api: Api, api_token: None) -> None:
    flow, (a, b) = a_chain_with_its_parent_running()
    assert api.call("POST", f"/api/tasks/{a}/cancel")[0] == 200
    status, body = api.call("POST", f"/api/tasks/{b}/requeue")
    assert status == 200, body
    assert cancelled_again(b)
    assert_final_with_nothing_to_repair(flow, "FAILED", failed=2)


# -- two connections ------------------------------------------------------------------------------


def held_open(action: Callable[[], Any]) -> tuple[OnItsOwnConnection, threading.Event]:
    """``action`` in a transaction on a connection of its own, held open (uncommitted) until the
    returned event is set."""
    done, release = threading.Event(), threading.Event()

    def work() -> Any:
        with transaction.atomic():
            result = action()
            done.set()
            assert release.wait(60)
        return result

    holder = OnItsOwnConnection(work)
    holder.start()
    assert done.wait(60) or holder.error is not None, "the held action did not run"
    return holder, release


def waiting_for_it(action: Callable[[], Any]) -> OnItsOwnConnection:
    """``action`` on a connection of its own, once it waits for a lock (or has ended)."""
    other = OnItsOwnConnection(action)
    other.start()
    other.ready.wait(60)
    wait_until(lambda: waits_for_a_lock(other.pid) or not other.is_alive(), 60, what="the action to wait or end")
    return other


def test_a_requeue_waiting_for_an_uncommitted_cancel_of_the_parent_cancels_the_dependant_again() -> None:
    """A's cancel is done, not committed, when B's requeue comes: the requeue waits for it (the
    workflow's settle lock), reads A CANCELLED and cancels B again, counted once."""
    flow, a, b = a_chain_that_ran_with_its_parent_running_again()
    canceller, release = held_open(lambda: cancel(a))
    operator = waiting_for_it(lambda: requeue(b))
    assert waits_for_a_lock(operator.pid), "the requeue did not wait for the cancel's transaction"
    release.set()
    assert canceller.outcome() == 1
    assert operator.outcome() == 1
    assert cancelled_again(b)
    assert_final_with_nothing_to_repair(flow, "FAILED", failed=2)


def test_a_cancel_of_the_parent_waiting_for_an_uncommitted_requeue_cancels_the_dependant() -> None:
    """The other order: B's requeue is done (B waits for A's rerun), not committed, when A's cancel
    comes: the cancel waits for it, then cancels B with A."""
    flow, a, b = a_chain_that_ran_with_its_parent_running_again()
    operator, release = held_open(lambda: requeue(b))
    canceller = waiting_for_it(lambda: cancel(a))
    assert waits_for_a_lock(canceller.pid), "the cancel did not wait for the requeue's transaction"
    release.set()
    assert operator.outcome() == 1
    assert canceller.outcome() == 1
    assert state(a, b) == [("CANCELLED", 0), ("CANCELLED", 0)]
    assert_final_with_nothing_to_repair(flow, "FAILED", failed=2)


def test_a_requeue_held_open_after_the_cancel_committed_leaves_the_workflow_failed_for_the_other_connection() -> None:
    """chain(A, B), A cancelled while it runs; B's requeue is held open on one connection: another
    connection sees the workflow final throughout (FAILED, nothing remaining), before and after."""
    flow, (a, b) = a_chain_with_its_parent_running()
    assert cancel(a) == 1
    operator, release = held_open(lambda: requeue(b))
    try:
        assert counts(flow) == ("FAILED", 2, 0, 2)
    finally:
        release.set()
    assert operator.outcome() == 1
    assert cancelled_again(b)
    assert_final_with_nothing_to_repair(flow, "FAILED", failed=2)
