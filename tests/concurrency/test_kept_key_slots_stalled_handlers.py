"""Key slots kept for handlers that outlive their rows, with real workers.

A keyed attempt whose lease lapses while its worker lives on (the attempt alone stalled: the demo's
latency spike, ``Execution.miss_heartbeats``) is requeued by recovery, which keeps a slot for its
handler (RECOVER_EXPIRED_SQL's ``kept``). The key's limit is "at most N of its handlers running" on the
database clock (the handlers' own start and end marks).


Found by breaker 20, item 7 (the bug hunt on issue 20: concurrency keys and worker identity at scale)."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.maintenance.recovery import recover_once
from tasks.models import ConcurrencyHold, Task, TaskStatus
from tests.concurrency.test_concurrency_keys import SPAN, max_overlap
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

STALLED = "tests.testapp.handlers.stalled_span"
PAST_EXPIRY = "tests.testapp.handlers.stall_past_expiry"


def serial(path: str, key: str, **kwargs: Any) -> int:
    return Task.objects.enqueue(path, kwargs=kwargs, concurrency_key=key, concurrency_limit=1, max_attempts=3).id


def ended(task_id: int, attempt: int) -> bool:
    return Effect.objects.filter(task_id=task_id, attempt=attempt, phase="ended").exists()


def test_a_stalled_keyed_attempt_and_its_requeued_attempt_never_run_side_by_side(workers: Workers) -> None:
    """Limit 1: the first attempt stalls (no heartbeats for 2 x TTL) while its worker lives on; recovery
    requeues it and keeps a slot for the stalled handler. The requeued attempt must not start before
    the stalled handler has returned (a limit bounds handlers running, not rows)."""
    stalled = serial(STALLED, "k", stall=4.0)
    workers.start("a", "--concurrency", "2")
    workers.start("b", "--concurrency", "2")
    wait_until(
        lambda: Task.objects.get(pk=stalled).status == TaskStatus.SUCCESSFUL and ended(stalled, 1),
        60,
        0.1,
        what="the requeued attempt to succeed and the stalled handler to return",
    )
    assert Task.objects.get(pk=stalled).crashes == 1  # the stall was charged: recovery saw a live worker
    # Before the requeued attempt ran, both handlers of the key were between their marks at once.
    assert max_overlap("k") == 1


def test_a_slot_kept_by_recovery_after_the_stalled_handler_returned_is_given_back(workers: Workers) -> None:
    """The stalled handler returns just after its lease ran out (its late result is refused), and
    recovery (here from the test's own connection, as ``recover_tasks --once`` or the worker's next
    round would) requeues the attempt within a beat of the expiry: a crash charged to the task, its
    worker alive, so recovery keeps a slot for a handler that has already returned. The worker gave
    back what it had kept when its handler returned (nothing, then) and never looks again: the slot
    stays kept while the worker lives, and the key's next task waits for ever."""
    stalled = serial(PAST_EXPIRY, "k")
    following = serial(SPAN, "k")
    assert Task.objects.get(pk=following).status == TaskStatus.BLOCKED
    workers.start("w", "--concurrency", "2", "--no-recovery", "--ttl", "6")
    wait_until(lambda: ended(stalled, 1), 30, 0.02, what="the stalled handler to return")
    wait_until(lambda: "outcome REJECTED" in workers.log("w"), 10, 0.02, what="the late result to be refused")

    report = recover_once()
    assert report.requeued == [stalled]
    assert Task.objects.get(pk=stalled).crashes == 1  # charged: its worker lived on
    # The worker runs the requeued attempt; then the key's slot is free: nothing of the key runs.
    wait_until(lambda: Task.objects.get(pk=stalled).status == TaskStatus.SUCCESSFUL, 30, 0.1, what="the rerun")

    def next_ran() -> bool:
        recover_once()  # the sweep too
        return Task.objects.get(pk=following).status == TaskStatus.SUCCESSFUL

    held = list(ConcurrencyHold.objects.values_list("task_id", "reason", "worker"))
    wait_until(next_ran, 15, 0.5, what=f"the key's next task to run (slots kept: {held})")
    assert not ConcurrencyHold.objects.exists()


def test_a_handler_that_returns_while_its_slot_is_being_kept_gives_it_back(workers: Workers) -> None:
    """The worker abandons a keyed attempt at its timeout: ``ledger.abandon``, then KEEP_SLOTS_SQL (a
    round trip), then ``mark_lost``. A handler that returns during that round trip is neither lost
    (``handler_returned`` gives nothing back) nor finished (its result is dropped as abandoned), and the
    insert then keeps a slot for a handler that has returned: kept while the worker lives. A slow round
    trip is stood in for by another session holding a lock on tasks_concurrencyhold for a moment
    (less than the worker's lock timeout: the keep succeeds)."""
    from django.db import connections

    timed_out = Task.objects.enqueue(
        SPAN, kwargs={"seconds": 0.8}, concurrency_key="k", concurrency_limit=1, timeout=0.5, max_attempts=1
    ).id
    following = serial(SPAN, "k")
    blocker = connections.create_connection("default")
    try:
        blocker.set_autocommit(False)
        with blocker.cursor() as cursor:
            cursor.execute("LOCK TABLE tasks_concurrencyhold IN SHARE ROW EXCLUSIVE MODE")
        workers.start("w", "--concurrency", "2", "--no-recovery", "--ttl", "9")  # lock timeout 1.5 s
        wait_until(lambda: ended(timed_out, 1), 30, 0.02, what="the handler to return past its timeout")
    finally:
        blocker.rollback()
        blocker.close()
    wait_until(lambda: Task.objects.get(pk=timed_out).status == TaskStatus.FAILED, 30, 0.05, what="the timeout")
    assert "could not keep" not in workers.log("w")  # the keep went through, after the handler returned

    def next_ran() -> bool:
        recover_once()
        return Task.objects.get(pk=following).status == TaskStatus.SUCCESSFUL

    held = list(ConcurrencyHold.objects.values_list("task_id", "reason", "worker"))
    wait_until(next_ran, 15, 0.5, what=f"the key's next task to run (slots kept: {held})")
    assert not ConcurrencyHold.objects.exists()


def test_timed_out_async_handlers_whose_work_runs_in_a_thread_never_overlap(workers: Workers) -> None:
    """Limit 1, ``timeout=0.5``, async handlers whose 1.5 s of work is blocking code in a thread
    (``sync_to_async``). The cancelled coroutine returns at once, but its thread goes on: the slot is
    given back while the handler's work still runs, and the key's next handler starts beside it."""
    ids = [
        Task.objects.enqueue(
            "tests.testapp.handlers.async_span_in_thread",
            kwargs={"seconds": 1.5},
            concurrency_key="athread",
            concurrency_limit=1,
            timeout=0.5,
            max_attempts=1,
        ).id
        for _ in range(3)
    ]
    workers.start("w", "--concurrency", "1", "--async-concurrency", "4")
    wait_until(
        lambda: Effect.objects.filter(task_id__in=ids, phase="ended").count() == 3,
        60,
        0.1,
        what="every handler's work to end",
    )
    assert set(Task.objects.filter(pk__in=ids).values_list("status", flat=True)) == {TaskStatus.FAILED}
    assert max_overlap("athread") == 1
