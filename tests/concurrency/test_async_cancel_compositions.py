"""The async executor's cancel-once guard (aio._cancel_once) attacked with cancellations composed on
real worker processes: an operator's cancel, a lost lease (expired under the worker with an UPDATE)
or a timeout cancels a coroutine, and while its cleanup still awaits (recorded as the effect
"cleaning"), the worker is SIGTERMed: the shutdown asks to cancel again, from stop() and from the
ticker. The cleanup runs once and to its end (its last await writes the effect "cancelled"), the worker
exits (code 0), and the row ends once, recorded. And a coroutine that swallows the shutdown's
cancellation and sleeps on for ever: the worker still stops (it does not wait for it: ``STOP_WITHIN``
is a hang guard), the row handed back once, nothing double-finished."""

from __future__ import annotations

import signal
import subprocess

import pytest
from django.db import connection

from tasks.models import Task, TaskStatus
from tests.concurrency.test_async_executor import H, charges, effects, wait_for_end
from tests.helpers import wait_until, worker_row
from tests.helpers.workers import STOP_WITHIN, Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

#: Longer than the loop's tick (aio.TICK, 0.1 s) many times over: the shutdown's cancels from stop()
#: and the ticker land while it awaits. Shorter than the grace and the lost-lease give-up (3 s).
CLEANUP = 1.5


def started(task_id: int) -> bool:
    return bool(effects(task_id, "started")) and Task.objects.filter(pk=task_id, attempt_started=True).exists()


def sigterm_during_cleanup(proc: subprocess.Popen[bytes], task_id: int) -> None:
    wait_until(lambda: effects(task_id, "cleaning") == 1, 30, what="the cleanup to begin")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(STOP_WITHIN) == 0  # a hang guard


def assert_cleanup_ran_once_to_its_end(task_id: int) -> None:
    # The worker has exited: what its cleanup wrote is all there will be.
    assert (effects(task_id, "cleaning"), effects(task_id, "cancelled")) == (1, 1)


def test_operator_cancel_then_sigterm_lets_the_cleanup_finish_once(workers: Workers) -> None:
    proc = workers.start("op-then-term", "--shutdown-grace", "5")
    task_id = Task.objects.enqueue(H + "async_wait_cancelled", kwargs={"cleanup": CLEANUP, "mark": True}).id
    wait_until(lambda: started(task_id), 30, what="the coroutine to start")
    assert Task.objects.filter(pk=task_id).cancel() == 1
    sigterm_during_cleanup(proc, task_id)
    assert_cleanup_ran_once_to_its_end(task_id)
    task = Task.objects.get(pk=task_id)
    assert (task.status, charges(task)) == (TaskStatus.CANCELLED, (0, 0, 0))
    assert [e["kind"] for e in task.errors] == ["cancel"]  # the operator's entry, nothing after it
    stats = worker_row("op-then-term").stats
    assert (stats["failed"], stats["succeeded"]) == (0, 0), stats


def test_lost_lease_then_sigterm_lets_the_cleanup_finish_once(workers: Workers) -> None:
    proc = workers.start("lost-then-term", "--no-recovery", "--shutdown-grace", "5")
    task_id = Task.objects.enqueue(
        H + "async_wait_cancelled", kwargs={"cleanup": CLEANUP, "mark": True}, max_attempts=1
    ).id
    wait_until(lambda: started(task_id), 30, what="the coroutine to start")
    token = Task.objects.get(pk=task_id).token
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET expires_at = clock_timestamp() WHERE id = %s", [task_id])
    sigterm_during_cleanup(proc, task_id)
    assert_cleanup_ran_once_to_its_end(task_id)
    task = Task.objects.get(pk=task_id)
    # Handed back by the worker that lost it (no recovery ran), uncharged, one entry for the attempt.
    assert task.status == TaskStatus.READY and charges(task) == (0, 0, 0), task.errors
    assert [(e["kind"], e["token"]) for e in task.errors] == [("shutdown", token)]


def test_timeout_then_sigterm_lets_the_cleanup_finish_once(workers: Workers) -> None:
    proc = workers.start("timeout-then-term", "--shutdown-grace", "5")
    task_id = Task.objects.enqueue(
        H + "async_wait_cancelled", kwargs={"cleanup": CLEANUP, "mark": True}, timeout=0.5, max_attempts=1
    ).id
    sigterm_during_cleanup(proc, task_id)
    assert_cleanup_ran_once_to_its_end(task_id)
    task = wait_for_end(task_id, 5)
    assert (task.status, charges(task)) == (TaskStatus.FAILED, (1, 0, 0)), task.errors
    [entry] = task.errors
    assert entry["exception_class_path"] == "tasks.exceptions.TaskTimeout"


def test_a_coroutine_swallowing_the_shutdowns_cancel_is_handed_back_once(workers: Workers) -> None:
    proc = workers.start("swallow-term", "--shutdown-grace", "1")
    task_id = Task.objects.enqueue(H + "async_swallow_cancel", max_attempts=2).id
    wait_until(lambda: started(task_id), 30, what="the coroutine to start")
    token = Task.objects.get(pk=task_id).token
    proc.send_signal(signal.SIGTERM)
    # The coroutine never ends (it swallows every cancel and sleeps an hour): a stop that waited for
    # it would still be running at the hang guard.
    assert proc.wait(STOP_WITHIN) == 0
    task = Task.objects.get(pk=task_id)
    assert task.status == TaskStatus.READY and charges(task) == (0, 0, 0), task.errors
    assert [(e["kind"], e["token"]) for e in task.errors] == [("shutdown", token)]
    assert effects(task_id, "swallowed") == 1
    assert worker_row("swallow-term").stats["failed"] == 0
