"""The async executor against hostile handlers, with real worker processes and the real database: handlers
that swallow cancellation, leave tasks behind them, call the sync ORM, block the loop through the
shutdown, and look for current_task() where another coroutine's could leak in.

Found by a bug hunt (breaker) on issue 13's async execution."""

from __future__ import annotations

import signal

import pytest
from django.db import connection

from tasks.models import Task, TaskStatus
from tests.concurrency.test_async_executor import (
    STOP_WITHIN,
    Workers,
    all_ended,
    assert_serves,
    assert_stops,
    charges,
    effects,
    wait_for_end,
)
from tests.helpers import wait_until, worker_row
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."


def test_coroutine_swallowing_cancellation_past_its_timeout_does_not_wedge_or_hang_shutdown(workers: Workers) -> None:
    proc = workers.start("swallow-t", "--async-concurrency", "2", "--shutdown-grace", "1")
    stuck = Task.objects.enqueue(H + "async_swallow_cancel", timeout=0.5, max_attempts=1).id
    task = wait_for_end(stuck)
    assert (task.status, charges(task)) == (TaskStatus.FAILED, (1, 0, 0)), task.errors
    assert task.errors[0]["exception_class_path"] == "tasks.exceptions.TaskTimeout"
    wait_until(lambda: effects(stuck, "swallowed") == 1, what="the cancellation to be swallowed")
    # Both slots still serve (the zombie does not count against the capacity).
    ids = [Task.objects.enqueue(H + "async_sleep", kwargs={"seconds": 0.01}).id for _ in range(4)]
    wait_until(lambda: all_ended(ids), 30, what="later coroutines to finish")
    assert_serves("swallow-t")
    # The zombie swallows every cancellation and sleeps on for ever: a shutdown that waited for it
    # would never end (STOP_WITHIN is a hang guard, not a deadline). It stops, cleanly.
    assert_stops(proc, "swallow-t")


def test_coroutine_swallowing_cancellation_after_losing_its_lease_frees_its_slot(workers: Workers) -> None:
    """One coroutine slot; the coroutine in it loses its lease and ignores the cancellation. The
    lost attempt cannot finish, so it must not keep the worker's only slot for ever: the task is
    recovered and run again (attempt 2 returns at once), and other coroutines run."""
    proc = workers.start("swallow-l", "--async-concurrency", "1", "--concurrency", "1")
    task_id = Task.objects.enqueue(H + "async_swallow_cancel", kwargs={"only_first": True}, max_attempts=3).id
    wait_until(
        lambda: effects(task_id, "started") and Task.objects.filter(pk=task_id, attempt_started=True).exists(),
        what="the coroutine to start",
    )
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET expires_at = clock_timestamp() WHERE id = %s", [task_id])
    wait_until(lambda: effects(task_id, "swallowed") == 1, what="the cancellation to be swallowed")
    after = Task.objects.enqueue(H + "async_sleep", kwargs={"seconds": 0.01}).id
    done = wait_for_end(after, 30)
    assert done.status == TaskStatus.SUCCESSFUL, done.errors
    task = wait_for_end(task_id, 30)
    assert (task.status, task.return_value) == (TaskStatus.SUCCESSFUL, "attempt 2"), task.errors
    assert_stops(proc, "swallow-l")


def test_tasks_a_coroutine_leaves_behind_cannot_write_or_stop_the_worker(workers: Workers) -> None:
    proc = workers.start("orphans")
    task_id = Task.objects.enqueue(H + "async_spawn_orphans").id
    task = wait_for_end(task_id)
    assert (task.status, task.return_value) == (TaskStatus.SUCCESSFUL, "spawned"), task.errors
    # The orphan's checkpoint, after the attempt ended, is refused by the compare-and-set.
    orphan = wait_until(
        lambda: Effect.objects.filter(task_id=task_id, phase__startswith="orphan:").first(),
        what="the orphan's checkpoint",
    )
    assert orphan.phase == "orphan:False"
    assert Task.objects.get(pk=task_id).progress != {"orphan": True}
    # SystemExit / KeyboardInterrupt raised by the orphans on the loop stopped nothing.
    assert proc.poll() is None
    assert_serves("orphans")
    assert_stops(proc, "orphans")


def test_sync_orm_called_from_a_coroutine_is_a_recorded_failure(workers: Workers) -> None:
    proc = workers.start("sync-orm")
    task = wait_for_end(Task.objects.enqueue(H + "async_sync_orm", max_attempts=1).id)
    assert (task.status, charges(task)) == (TaskStatus.FAILED, (1, 0, 0)), task.errors
    assert task.errors[0]["exception_class_path"] == "django.core.exceptions.SynchronousOnlyOperation"
    assert_serves("sync-orm")
    assert_stops(proc, "sync-orm")


def test_current_task_never_shows_another_coroutines_attempt_anywhere(workers: Workers) -> None:
    proc = workers.start("ident2", "--async-concurrency", "100", "--batch-size", "50", "--concurrency", "2")
    ids = Task.objects.bulk_enqueue(H + "async_identity_everywhere", [{"pause": 0.05}] * 100)
    syncs = Task.objects.bulk_enqueue(H + "sync_identity", [{}] * 10)
    wait_until(lambda: all_ended([*ids, *syncs]), 60, what="every task to finish")
    for task in Task.objects.filter(pk__in=ids):
        assert task.status == TaskStatus.SUCCESSFUL, task.errors
        value = task.return_value
        assert isinstance(value, dict)
        own = task.id
        assert (value["own"], value["after"], value["to_thread"], value["child_task"]) == (own,) * 4, value
        assert value["thread_sensitive"] == own, value
        # run_in_executor copies no context: it may see nothing, but never another attempt.
        assert value["run_in_executor"] in (own, None), value
    for task in Task.objects.filter(pk__in=syncs):
        assert (task.status, task.return_value) == (TaskStatus.SUCCESSFUL, task.id), task.errors
    assert_stops(proc, "ident2")


def test_shutdown_completes_while_a_coroutine_blocks_the_loop(workers: Workers) -> None:
    """The watchdog's limit and the task's timeout are far away; SIGTERM arrives while the loop is
    blocked (for 600 s). The process stops though the loop never comes back: it waits for neither
    (each is far beyond the hang guard, STOP_WITHIN), and the task is not lost or charged."""
    proc = workers.start("frozen", "--shutdown-grace", "1", TASKS_ASYNC_BLOCK_LIMIT="300")
    task_id = Task.objects.enqueue(H + "async_block_forever", max_attempts=2, timeout=300).id
    wait_until(lambda: effects(task_id, "started") == 1, what="the loop to block")
    proc.send_signal(signal.SIGTERM)
    proc.wait(STOP_WITHIN)  # raises if it is still running: the stop waited for the blocked loop
    assert worker_row("frozen").stop_reason == "stopped"
    row = Task.objects.get(pk=task_id)
    # Handed back (uncharged) at shutdown, or at worst left to expire for recovery: never lost, and
    # neither timed out nor ended by the watchdog (the stop came first: either would charge it).
    assert row.status in (TaskStatus.READY, TaskStatus.RUNNING), row.status
    assert charges(row) == (0, 0, 0)


def test_handler_object_with_an_async_call_runs_as_a_coroutine(workers: Workers) -> None:
    proc = workers.start("callable")
    task = wait_for_end(Task.objects.enqueue(H + "async_callable", kwargs={"value": 5}, max_attempts=1).id)
    assert (task.status, task.return_value) == (TaskStatus.SUCCESSFUL, {"value": 5, "task": task.id}), task.errors
    assert_stops(proc, "callable")
