"""The Worker class in a thread of the test process: retries, checkpoints, django.tasks, timeouts."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from tasks.compat import TaskResult, TaskResultStatus, task_finished, task_started
from tasks.models import Task, TaskStatus
from tasks.worker.process import Worker
from tests.helpers import wait_until, worker_names
from tests.testapp import handlers

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def worker_with_quick_retries(settings: Any) -> Iterator[Worker]:
    settings.LEASING_TASKS = {"BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05}
    worker = Worker(
        concurrency=2, ttl=2, poll_interval=0.05, recovery_interval=0.1, install_signal_handlers=False, worker_id="t1"
    )

    def run() -> None:
        try:
            worker.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    yield worker
    worker.request_stop()
    worker.request_stop()
    thread.join(30)
    assert not thread.is_alive()


def refreshed(result: TaskResult) -> TaskResult:
    result.refresh()
    return result


def wait_finished(result: TaskResult) -> None:
    wait_until(lambda: refreshed(result).is_finished, 20, what=f"{result.task.name} to finish")


def finished(task_id: int) -> Task:
    return wait_until(
        lambda: Task.objects.filter(pk=task_id, status__in=["SUCCESSFUL", "FAILED", "CANCELLED"]).first(),
        20,
        what=f"task {task_id} to finish",
    )


def test_failures_are_retried_with_every_error_kept(worker_with_quick_retries: Worker) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.fail_until", kwargs={"succeed_on": 3}, max_attempts=3).id
    task = finished(task_id)
    assert (task.status, task.attempts, task.return_value) == ("SUCCESSFUL", 3, "succeeded on attempt 3")
    assert [e["message"] for e in task.errors] == ["attempt 1 fails on purpose", "attempt 2 fails on purpose"]
    assert all(
        "Traceback" in e["traceback"] and e["exception_class_path"] == "builtins.ValueError" for e in task.errors
    )


def test_out_of_attempts_ends_failed(worker_with_quick_retries: Worker) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.fail_until", kwargs={"succeed_on": 9}, max_attempts=2).id
    task = finished(task_id)
    assert (task.status, task.attempts, len(task.errors)) == ("FAILED", 2, 2)


def test_unknown_handler_fails_without_retrying(worker_with_quick_retries: Worker) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.missing", max_attempts=5).id
    task = finished(task_id)
    assert (task.status, task.attempts) == ("FAILED", 1)
    assert task.errors[0]["exception_class_path"] == "builtins.ImportError"


def test_retry_resumes_from_the_last_checkpoint(worker_with_quick_retries: Worker) -> None:
    task = finished(Task.objects.enqueue("tests.testapp.handlers.resume").id)
    assert task.return_value == {"resumed_from": 3, "attempt": 2}


def test_dedup_key_returns_the_unfinished_task(worker_with_quick_retries: Worker) -> None:
    # Deferred, so it is certainly still unfinished when the duplicate arrives.
    later = timezone.now() + dt.timedelta(hours=1)
    first = Task.objects.enqueue("tests.testapp.handlers.noop", dedup_key="job-1", run_after=later)
    second = Task.objects.enqueue("tests.testapp.handlers.noop", dedup_key="job-1")
    assert (second.id, second.created) == (first.id, False)
    Task.objects.filter(pk=first.id).retry_now()
    assert finished(first.id).status == "SUCCESSFUL"
    third = Task.objects.enqueue("tests.testapp.handlers.noop", dedup_key="job-1")
    assert third.created
    assert third.id != first.id


def test_timeout_abandons_the_attempt_and_the_next_attempt_in_the_same_process_is_unaffected(
    worker_with_quick_retries: Worker,
) -> None:
    """Attempt 1 overruns its timeout: it is recorded as timed out at once and no longer heartbeated.
    Attempt 2 of the same task runs in the same worker while attempt 1's thread is still stuck, and
    when attempt 1 finally returns, its late result evicts nothing and changes nothing."""
    from tests.testapp.models import Gate

    Gate.objects.create(key="slow")
    task_id = Task.objects.enqueue(
        "tests.testapp.handlers.slow_first", kwargs={"gate": "slow"}, timeout=0.5, max_attempts=2
    ).id
    task = finished(task_id)
    assert task.status == "SUCCESSFUL"
    assert task.return_value == {"attempt": 2}
    assert [(e["attempt"], e["exception_class_path"]) for e in task.errors] == [(1, "tasks.exceptions.TaskTimeout")]
    assert (task.attempts, task.failures, task.crashes) == (2, 1, 0)
    assert worker_with_quick_retries.stats["timed_out"] == 1
    Gate.objects.filter(key="slow").update(open=True)  # attempt 1's handler returns now, late
    wait_until(
        lambda: worker_with_quick_retries.stats["late_results_dropped"] >= 1, 20, what="the late result to be dropped"
    )
    task.refresh_from_db()
    assert (task.status, task.return_value) == ("SUCCESSFUL", {"attempt": 2})
    assert worker_with_quick_retries.stats["succeeded"] == 1


def test_django_tasks_round_trip(worker_with_quick_retries: Worker) -> None:
    events: list[tuple[str, str]] = []

    def on_started(sender: Any, task_result: Any, **kwargs: Any) -> None:
        events.append(("started", task_result.id))

    def on_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
        events.append(("finished", task_result.status))

    task_started.connect(on_started)
    task_finished.connect(on_finished)
    try:
        result = handlers.add.enqueue(2, 3)
        assert result.status == TaskResultStatus.READY
        # task_finished comes once the outcome is stored: after the row says SUCCESSFUL.
        wait_until(lambda: len(events) == 2, 20, what="add() to finish and be signalled")
        result.refresh()
    finally:
        task_started.disconnect(on_started)
        task_finished.disconnect(on_finished)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5
    assert result.attempts == 1
    assert worker_names(result.worker_ids) == ["t1"]
    assert handlers.add.get_result(result.id).return_value == 5
    assert events == [("started", result.id), ("finished", TaskResultStatus.SUCCESSFUL)]


def test_django_tasks_context_async_and_errors(worker_with_quick_retries: Worker) -> None:
    with_context = handlers.context_info.enqueue(label="x")
    doubled = handlers.async_double.enqueue(21)
    broken = handlers.explode.enqueue()
    for result in (with_context, doubled, broken):
        wait_finished(result)
    info = with_context.return_value
    assert (info["attempt"], info["label"], info["progress"]) == (1, "x", {"label": "x"})
    assert info["token"] > 0
    assert doubled.return_value == 42
    assert broken.status == TaskResultStatus.FAILED
    assert broken.errors[-1].exception_class_path == "builtins.KeyError"
    assert broken.errors[-1].exception_class is KeyError


def test_django_tasks_priority_and_run_after_are_honoured(worker_with_quick_retries: Worker) -> None:
    worker_with_quick_retries.request_stop()  # stop claiming, then enqueue with priorities, then run a fresh worker
    wait_until(lambda: Task.objects.running().count() == 0, what="idle")
    later = handlers.add.using(run_after=timezone.now() + dt.timedelta(seconds=1.5)).enqueue(1, 1)
    low = handlers.add.using(priority=-10).enqueue(1, 2)
    high = handlers.add.using(priority=10).enqueue(1, 3)
    claimed = Task.objects.claim("probe", limit=10)
    assert [c.id for c in claimed] == [int(high.id), int(low.id)]  # run_after not due yet
    Task.objects.complete_many("probe", [(c.id, c.token, "0") for c in claimed])
    assert Task.objects.claim("probe", limit=10) == []
    due = wait_until(lambda: Task.objects.claim("probe", limit=10), 10, what="the deferred task to become due")
    assert [c.id for c in due] == [int(later.id)]
    assert due[0].enqueued_at + dt.timedelta(seconds=1.4) <= timezone.now()


def test_get_result_of_an_unknown_id_raises() -> None:
    from tasks.compat import TaskResultDoesNotExist

    with pytest.raises(TaskResultDoesNotExist):
        handlers.add.get_result("999999")
    with pytest.raises(TaskResultDoesNotExist):
        handlers.add.get_result("not-a-number")


def test_cancelled_task_maps_to_failed_and_running_cancel_is_lost_by_the_worker(
    worker_with_quick_retries: Worker,
) -> None:
    result = handlers.add.using(run_after=timezone.now() + dt.timedelta(hours=1)).enqueue(1, 1)
    Task.objects.filter(pk=int(result.id)).cancel()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert Task.objects.get(pk=int(result.id)).status == TaskStatus.CANCELLED


def test_an_isolated_task_runs_alone_in_its_worker(worker_with_quick_retries: Worker) -> None:
    """A task whose workers vanished beside other attempts ISOLATE_AFTER times runs alone, so that if
    it is the one killing them, the next crash is attributable."""
    from django.db import transaction

    from tests.testapp.models import Effect, Gate

    def started(task_id: int) -> bool:
        return Effect.objects.filter(task_id=task_id, phase="started").exists()

    Gate.objects.create(key="a")
    Gate.objects.create(key="b")
    first = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "a"}).id
    wait_until(lambda: started(first), what="the first task to start")
    with transaction.atomic():
        suspect = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "b"}).id
        Task.objects.filter(pk=suspect).update(shared_crashes=2)
    # A free executor exists (concurrency 2), yet the suspect waits for the running task to end.
    with pytest.raises(AssertionError, match="timed out"):
        wait_until(lambda: started(suspect), 1.0, what="the suspect to start beside another task", expect_timeout=True)
    Gate.objects.filter(key="a").update(open=True)
    wait_until(lambda: started(suspect), 20, what="the suspect to start alone")
    assert Task.objects.get(pk=suspect).attempt_isolated
    later = Task.objects.enqueue("tests.testapp.handlers.record").id
    with pytest.raises(AssertionError, match="timed out"):
        wait_until(
            lambda: Effect.objects.filter(task_id=later).exists(),
            1.0,
            what="a task to start beside it",
            expect_timeout=True,
        )
    Gate.objects.filter(key="b").update(open=True)
    assert finished(suspect).status == "SUCCESSFUL"
    assert finished(later).status == "SUCCESSFUL"


def test_a_stop_ends_an_idle_worker_at_once_whatever_its_poll_interval() -> None:
    """The listener waits on its connection and on a stop pipe together: a stop request does not
    wait for that wait (here up to the 60 s poll interval) to time out."""
    worker = Worker(poll_interval=60, ttl=2, recovery=False, install_signal_handlers=False, worker_id="stop-now")

    def run() -> None:
        try:
            worker.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    try:

        def listening() -> bool:
            with connections["default"].cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND"
                    " query LIKE 'LISTEN leasing_tasks%%'"
                )
                return bool(cursor.fetchone()[0])

        wait_until(listening, what="the listener to wait for notifications")
        worker.request_stop()
        thread.join(10)
        assert not thread.is_alive(), "the stop waited for the listener's poll"
    finally:
        worker.request_stop()
        thread.join(70)


def test_a_cut_met_by_a_retried_statement_is_counted() -> None:
    """Every path of the worker's own statements that meets a cut connection counts it, not only the
    dispatcher's round: a hand-back that found its connection killed once left the count unchanged,
    and a test waiting for the cut to be noticed timed out."""
    from django.db import connection

    from tasks.worker.session import retrying

    worker = Worker(concurrency=1, ttl=5, install_signal_handlers=False, worker_id="counted")
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    killed: list[bool] = []

    def kill() -> None:  # from a second connection (Django gives each thread its own)
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
                killed.append(cursor.fetchone()[0])
        finally:
            connection.close()

    killer = threading.Thread(target=kill)
    killer.start()
    killer.join(10)
    assert killed == [True]
    calls: list[int] = []

    def statement() -> int:
        calls.append(1)
        return Task.objects.count()

    assert retrying("counting tasks", worker.session, statement) == 0
    assert len(calls) == 2  # the first met the cut, the second ran on a fresh connection
    assert worker.stats["connection_errors"] == 1


def test_a_worker_claims_four_tasks_a_thread_unless_told_otherwise(settings: Any) -> None:
    """The claim's size: four per executor thread (at least 16) by default, and four per event-loop
    slot for coroutines; then the setting, then the worker's own argument (``--batch-size``), for both."""
    assert Worker(concurrency=16, install_signal_handlers=False).batch_size == 64
    worker = Worker(concurrency=2, async_concurrency=32, install_signal_handlers=False)
    assert (worker.batch_size, worker.async_batch_size) == (16, 128)
    settings.LEASING_TASKS = {"BATCH_SIZE": 10}
    worker = Worker(concurrency=16, install_signal_handlers=False)
    assert (worker.batch_size, worker.async_batch_size) == (10, 10)
    worker = Worker(concurrency=16, batch_size=7, install_signal_handlers=False)
    assert (worker.batch_size, worker.async_batch_size) == (7, 7)
