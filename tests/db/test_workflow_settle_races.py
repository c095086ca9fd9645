"""A workflow member's settle against an operator's action on its dependant, committing in either order
(issue 38, DESIGN.md invariant 14).

``chain(A, B)`` has run; the operator requeues A (the parent first, as docs/howto/workflows.md
advises), then requeues B while A's rerun finishes. The requeue of B reads A's status to decide whether
B waits; A's finish counts down the dependants that wait. Each reads what the other has not committed
yet, so before the settle serialised on the workflow (migration 0027) B ended AWAITING behind a
SUCCESSFUL A for ever. Each race is played with two real connections on threads of their own, one
held inside its transaction at the step that matters, synchronised on what PostgreSQL shows (a
backend waiting for a lock), never on sleeps."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import transaction

from tasks.lifecycle.values import Failure
from tasks.models import Task, TaskStatus
from tasks.models import Workflow as WorkflowRow
from tasks.workflows import Workflow, chain, step
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)

NOOP = "tests.testapp.handlers.noop"


def state(*ids: int) -> list[tuple[str, int]]:
    rows = dict((i, (s, w)) for i, s, w in Task.objects.filter(pk__in=ids).values_list("id", "status", "waiting_on"))
    return [rows[i] for i in ids]


def run_all(worker: str = "w1") -> None:
    """Claim and finish what is runnable until nothing is (no handler runs: the statements only)."""
    for _ in range(20):
        claimed = Task.objects.claim(worker, limit=100)
        if not claimed:
            return
        Task.objects.complete_many(worker, [(t.id, t.token, "null") for t in claimed])


def claim_one(task_id: int, worker: str = "w1") -> Any:
    (claimed,) = Task.objects.claim(worker, limit=10)
    assert claimed.id == task_id
    return claimed


def finish(claimed: Any, worker: str = "w1") -> None:
    assert Task.objects.complete_many(worker, [(claimed.id, claimed.token, "null")])


def fail_for_good(claimed: Any, worker: str = "w1") -> None:
    assert Task.objects.fail(Failure(claimed.id, claimed.token, "builtins.ValueError", "boom", retry=False), worker)


def a_chain_that_ran() -> tuple[int, int, int]:
    done = chain(step(NOOP), step(NOOP), pipe=False).enqueue()
    run_all()
    a, b = done.task_ids
    assert state(a, b) == [("SUCCESSFUL", 0), ("SUCCESSFUL", 0)]
    return done.id, a, b


def assert_it_ends(flow: int, *ids: int) -> None:
    """Nothing waits behind a final parent: whatever is runnable runs, and the workflow ends."""
    run_all()
    assert [s for s, _ in state(*ids)] == ["SUCCESSFUL"] * len(ids), state(*ids)
    assert WorkflowRow.objects.get(pk=flow).status == "SUCCESSFUL"


def test_a_dependant_requeued_in_a_transaction_that_commits_after_its_parent_finished_runs() -> None:
    """The issue's first reproduction: B's requeue is inside a transaction that commits after A's
    rerun finished. The finish waits for the requeue's transaction (the workflow's settle lock), then
    counts B down."""
    flow, a, b = a_chain_that_ran()
    Task.objects.filter(pk=a).requeue()
    claimed = claim_one(a)
    requeued, release = threading.Event(), threading.Event()

    def requeue_b() -> None:
        with transaction.atomic():
            assert Task.objects.filter(pk=b).requeue() == 1
            requeued.set()
            assert release.wait(60)

    operator = OnItsOwnConnection(requeue_b)
    operator.start()
    assert requeued.wait(60)
    finisher = OnItsOwnConnection(lambda: finish(claimed))
    finisher.start()
    finisher.ready.wait(60)
    # The finish waits for the operator's transaction, or (before the fix) is already done.
    wait_until(lambda: waits_for_a_lock(finisher.pid) or not finisher.is_alive(), 60, what="the finish to wait or end")
    release.set()
    operator.outcome()
    finisher.outcome()
    assert state(a) == [("SUCCESSFUL", 0)]
    assert state(b) == [("READY", 0)], "B waits behind a SUCCESSFUL parent"
    assert_it_ends(flow, a, b)


def test_a_dependant_requeued_while_its_parents_finish_is_uncommitted_runs() -> None:
    """The other order: A's finish is done but its transaction not committed when B is requeued.
    The requeue waits for the finish's transaction, then reads A as it committed (SUCCESSFUL): B
    stays READY."""
    flow, a, b = a_chain_that_ran()
    Task.objects.filter(pk=a).requeue()
    claimed = claim_one(a)
    finished, release = threading.Event(), threading.Event()

    def finish_in_a_transaction() -> None:
        with transaction.atomic():
            finish(claimed)
            finished.set()
            assert release.wait(60)

    finisher = OnItsOwnConnection(finish_in_a_transaction)
    finisher.start()
    assert finished.wait(60)
    operator = OnItsOwnConnection(lambda: Task.objects.filter(pk=b).requeue())
    operator.start()
    operator.ready.wait(60)
    wait_until(lambda: waits_for_a_lock(operator.pid) or not operator.is_alive(), 60, what="the requeue to wait or end")
    release.set()
    finisher.outcome()
    assert operator.outcome() == 1
    assert state(b) == [("READY", 0)], "B waits behind a SUCCESSFUL parent"
    assert_it_ends(flow, a, b)


def test_a_dependant_requeued_while_its_parent_fails_for_good_is_cancelled_again() -> None:
    """The doom path races the same way: A fails for good (on_failure='cancel') while B's requeue is
    uncommitted. B must end CANCELLED (its parent failed), not AWAITING a parent that is final."""
    flow, a, b = a_chain_that_ran()
    Task.objects.filter(pk=a).requeue()
    claimed = claim_one(a)
    requeued, release = threading.Event(), threading.Event()

    def requeue_b() -> None:
        with transaction.atomic():
            assert Task.objects.filter(pk=b).requeue() == 1
            requeued.set()
            assert release.wait(60)

    operator = OnItsOwnConnection(requeue_b)
    operator.start()
    assert requeued.wait(60)
    failer = OnItsOwnConnection(lambda: fail_for_good(claimed))
    failer.start()
    failer.ready.wait(60)
    wait_until(lambda: waits_for_a_lock(failer.pid) or not failer.is_alive(), 60, what="the failure to wait or end")
    release.set()
    operator.outcome()
    failer.outcome()
    assert state(a) == [("FAILED", 0)]
    assert state(b)[0][0] == "CANCELLED", state(b)
    assert WorkflowRow.objects.get(pk=flow).status == "FAILED"


def test_a_requeue_and_a_finish_of_other_workflows_do_not_wait_for_each_other() -> None:
    """The settle lock is the workflow's: a requeue in one workflow held open does not hold up the
    finishes of another."""
    _flow, _a, b = a_chain_that_ran()
    other = chain(step(NOOP), step(NOOP), pipe=False).enqueue()
    requeued, release = threading.Event(), threading.Event()

    def requeue_b() -> None:
        with transaction.atomic():
            assert Task.objects.filter(pk=b).requeue() == 1
            requeued.set()
            assert release.wait(60)

    operator = OnItsOwnConnection(requeue_b)
    operator.start()
    try:
        assert requeued.wait(60)
        claimed = claim_one(other.task_ids[0])
        finish(claimed)  # on this thread: it would hang here if it waited for the other workflow
        assert state(other.task_ids[1]) == [("READY", 0)]
    finally:
        release.set()
    operator.outcome()


def test_a_snoozed_dependant_waits_again_when_its_parent_is_requeued() -> None:
    """Issue 38 item 5: B snoozed (READY, due later) when the operator requeues A: B waits for A's
    rerun (AWAITING), and is released only after it, keeping its own snooze."""
    done = chain(step(NOOP), step(NOOP)).enqueue()
    a, b = done.task_ids
    claimed_a = claim_one(a)
    finish(claimed_a)
    claimed_b = claim_one(b)
    snooze = Failure(claimed_b.id, claimed_b.token, "tasks.exceptions.Snooze", "", kind="snooze", delay=3600)
    assert Task.objects.fail(snooze, "w1")
    assert Task.objects.get(pk=b).status == TaskStatus.READY
    Task.objects.filter(pk=a).requeue()
    assert state(a, b) == [("READY", 0), ("AWAITING", 1)]
    (rerun,) = Task.objects.claim("w2", limit=10)
    assert rerun.id == a, "B ran before its parent's rerun"
    finish(rerun, "w2")
    assert state(b) == [("READY", 0)]
    assert Task.objects.get(pk=b).is_snoozed, "released again, B keeps its own snooze"
    Task.objects.filter(pk=b).retry_now()
    run_all()
    assert state(a, b) == [("SUCCESSFUL", 0), ("SUCCESSFUL", 0)]
    assert WorkflowRow.objects.get(pk=done.id).status == "SUCCESSFUL"


def test_a_graph_dependant_of_two_parents_counts_a_reopened_parent_once() -> None:
    """B depends on A1 and A2; A1 is requeued while B is READY (not claimed): B waits for one parent;
    A2 requeued too: two; both finish: B runs."""
    flow = Workflow("g")
    a1 = flow.add(step(NOOP))
    a2 = flow.add(step(NOOP))
    flow.add(step(NOOP), after=[a1, a2])
    done = flow.enqueue()
    ida1, ida2, idb = done.task_ids
    for _ in range(2):
        finish(claim_one_of((ida1, ida2)))
    assert state(idb) == [("READY", 0)]
    Task.objects.filter(pk=ida1).requeue()
    assert state(idb) == [("AWAITING", 1)]
    Task.objects.filter(pk=ida2).requeue()
    assert state(idb) == [("AWAITING", 2)]
    assert_it_ends(done.id, ida1, ida2, idb)


def claim_one_of(ids: tuple[int, ...]) -> Any:
    (claimed,) = Task.objects.claim("w1", limit=1)
    assert claimed.id in ids
    return claimed
