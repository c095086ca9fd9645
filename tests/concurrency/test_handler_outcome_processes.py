"""Issue 24 against real worker processes (``manage.py run_worker``): a snooze, cancel or discard is
a write like a finish, so the same faults must lose nothing and let no stale worker win.

- the fail statement carrying a snooze commits but its reply is lost: the worker asks the database
  where the attempt ended (a snooze leaves no error entry: ``snoozed_at`` after the grant tells) and
  neither re-sends nor counts it refused;
- the worker dies between the handler's end and the report (the statement held at a proxy, then
  SIGKILL): nothing was written, recovery requeues the task, and it runs to its end;
- a worker paused past its lease, whose task another worker has finished meanwhile, wakes up and
  snoozes, cancels or discards it: refused by the compare-and-set, the row unchanged.
"""

from __future__ import annotations

import os
import signal

import pytest

from tasks.models import FINISHED, Task, TaskStatus
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers import wait_until, worker_names, worker_row
from tests.helpers.pgproxy import PgProxy
from tests.helpers.workers import STOP_WITHIN, Workers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.outcome_handlers."
#: Only the fail statement (snooze, cancel, discard, failure) has this text.
FAIL_STATEMENT = b"AS d(id, token, error, retry, kind, delay, max_attempts, at)"


def wait_for_end(task_id: int, timeout: float = 30) -> Task:
    return wait_until(
        lambda: Task.objects.filter(pk=task_id, status__in=FINISHED).first(), timeout, what=f"task {task_id} to end"
    )


def stats(name: str) -> dict[str, int]:
    return dict(worker_row(name).stats or {})


def test_a_snooze_whose_reply_is_lost_is_found_landed_not_resent(proxy: PgProxy, workers: Workers) -> None:
    fault = proxy.drop_reply_after(FAIL_STATEMENT)
    proc = workers.start("lossy", "--async-concurrency", "0", DATABASE_URL=proxy.url_for(database_url()))
    task_id = Task.objects.enqueue(H + "snooze_then_finish", kwargs={"seconds": 0.5}).id
    assert fault.fired.wait(30)
    assert fault.status == b"I"  # no transaction open: the snooze committed
    task = wait_for_end(task_id)
    assert task.status == TaskStatus.SUCCESSFUL
    # One snooze, one charged attempt, no error, no crash: the lost reply cost nothing.
    assert (task.snoozes, task.attempts, task.failures, task.crashes, task.errors) == (1, 1, 0, 0, [])
    assert worker_names(task.worker_ids) == ["lossy"]
    assert Effect.objects.filter(task_id=task_id, phase="started").count() == 2
    wait_until(lambda: stats("lossy").get("reconciled", 0) >= 1, what="the worker to reconcile (its stats)")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(STOP_WITHIN) == 0
    final = stats("lossy")
    assert (final["snoozed"], final["rejected"], final["succeeded"]) == (1, 0, 1)


def test_a_worker_killed_between_the_handlers_end_and_the_report_loses_nothing(
    proxy: PgProxy, workers: Workers
) -> None:
    fault = proxy.freeze(FAIL_STATEMENT)
    doomed = workers.start("doomed", "--async-concurrency", "0", DATABASE_URL=proxy.url_for(database_url()))
    task_id = Task.objects.enqueue(H + "snooze_then_finish", kwargs={"seconds": 0.2}).id
    assert fault.fired.wait(30)  # the handler snoozed; the report is held before the server saw it
    doomed.kill()
    doomed.wait(10)
    proxy.kill_connections()  # the held-back report dies with its connection, never sent
    assert Task.objects.get(pk=task_id).status == TaskStatus.RUNNING  # nothing was written
    workers.start("rescuer")
    task = wait_for_end(task_id)
    assert task.status == TaskStatus.SUCCESSFUL
    # The lost snooze was never recorded; the task ran again (snoozing then, for real) and ended.
    assert task.snoozes == 1
    assert worker_names(task.worker_ids)[-1] == "rescuer"
    assert task.errors and task.errors[0]["exception_class_path"] == "tasks.exceptions.TaskLeaseLost"
    assert Effect.objects.filter(task_id=task_id, phase="started").count() == 3


@pytest.mark.parametrize("outcome", ["snooze", "cancel", "discard"])
def test_a_stale_worker_cannot_snooze_cancel_or_discard_a_task_it_lost(workers: Workers, outcome: str) -> None:
    Gate.objects.create(key="wake")
    stale = workers.start("stale", "--async-concurrency", "0")
    task_id = Task.objects.enqueue(H + "gated_outcome", kwargs={"gate": "wake", "outcome": outcome}).id
    wait_until(lambda: Effect.objects.filter(task_id=task_id).exists(), what="the first run to start")
    os.kill(stale.pid, signal.SIGSTOP)
    try:
        workers.start("fresh", "--async-concurrency", "0")
        task = wait_for_end(task_id)  # the lease lapsed, recovery requeued it, the fresh worker ran it
        assert (task.status, task.return_value, worker_names(task.worker_ids)[-1]) == (
            TaskStatus.SUCCESSFUL,
            "ran again",
            "fresh",
        )
        before = Task.objects.filter(pk=task_id).values().get()
        Gate.objects.filter(key="wake").update(open=True)
    finally:
        os.kill(stale.pid, signal.SIGCONT)
    # The stale handler now ends with its snooze / cancel / discard: refused, the row unchanged.
    wait_until(lambda: stats("stale").get("rejected", 0) >= 1, what="the stale worker's outcome to be refused")
    assert Task.objects.filter(pk=task_id).values().get() == before
    counter = {"snooze": "snoozed", "cancel": "cancelled", "discard": "discarded"}[outcome]
    assert stats("stale")[counter] == 0
