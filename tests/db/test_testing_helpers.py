"""tasks.testing: the capture reads the rows really inserted, the inline run ends attempts as a worker
does (inside the test's transaction), eager mode runs an enqueue's tasks at once, and each stops a
task that enqueues itself forever."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now

from tasks.compat import task_enqueued, task_finished, task_started
from tasks.exceptions import TaskTimeout
from tasks.models import QueueControl, Task, TaskStatus
from tasks.testing import Drained, EnqueueCapture, RunLimitReached, eager_tasks, run_until_empty, task_path
from tasks.workflows import chain, step
from tests.testapp import testing_handlers as h
from tests.testapp.handlers import add, fail_until
from tests.testapp.models import Effect, Once

pytestmark = pytest.mark.django_db

P = h.PATH


# -- the capture ------------------------------------------------------------------------------------


def test_the_capture_sees_every_kind_of_enqueue_and_nothing_from_before() -> None:
    before = Task.objects.enqueue(P + "record", args=["before"]).id
    capture = EnqueueCapture()
    plain = Task.objects.enqueue(P + "record", args=("plain",), queue="mail", priority=5).id
    bulk = Task.objects.bulk_enqueue(P + "record", [{"label": "x"}, {"label": "y"}])
    flow = chain(step(P + "record", "first"), step(add, 1), pipe=False).enqueue()
    result = add.enqueue(2, 3)

    assert [t.id for t in capture.tasks] == [plain, *bulk, *flow.task_ids, int(result.id)]
    assert before not in [t.id for t in capture.tasks]
    capture.assert_enqueued(P + "record", args=["plain"], queue="mail", priority=5)
    capture.assert_enqueued(h.record, args=("plain",))  # a function names its path; a tuple is stored as a list
    capture.assert_enqueued(P + "record", kwargs={"label": "y"}, count=1)
    capture.assert_enqueued(P + "record", count=4)
    assert len(capture.assert_enqueued(add, args=[2, 3])) == 1  # a django.tasks Task, through the backend
    capture.assert_enqueued(add, args=[1], count=1)  # the workflow's step
    capture.assert_not_enqueued(add, args=[3, 2])
    capture.assert_not_enqueued(P + "record", args=["before"])


def test_a_missing_task_fails_with_what_was_enqueued() -> None:
    capture = EnqueueCapture()
    with pytest.raises(AssertionError, match="Nothing was enqueued"):
        capture.assert_enqueued(h.send_welcome)
    h.sign_up("a@example.com")
    with pytest.raises(AssertionError) as failed:
        capture.assert_enqueued(h.send_welcome, args=["b@example.com"])
    message = str(failed.value)
    assert "expected at least one enqueued " + P + "send_welcome(args=['b@example.com'])" in message
    assert "args=['a@example.com'] kwargs={'lang': 'fr'}" in message
    with pytest.raises(AssertionError, match="exactly 2"):
        capture.assert_enqueued(h.send_welcome, count=2)
    with pytest.raises(AssertionError, match="expected no enqueued task, found 1"):
        capture.assert_not_enqueued()
    with pytest.raises(AssertionError, match="expected no enqueued"):
        capture.assert_not_enqueued(h.send_welcome, kwargs={"lang": "fr"})
    capture.assert_enqueued(h.send_welcome, args=["a@example.com"], kwargs={"lang": "fr"}, count=1)


def test_bad_expectations_are_refused_clearly() -> None:
    capture = EnqueueCapture()
    with pytest.raises(TypeError, match="import path"):
        capture.assert_enqueued(42)
    with pytest.raises(TypeError, match="list of positional"):
        capture.assert_enqueued(h.record, args="plain")
    with pytest.raises(TypeError, match="cannot be stored"):
        capture.assert_enqueued(h.record, kwargs={"x": object()})
    with pytest.raises(ValueError, match="count"):
        capture.assert_enqueued(h.record, count=-1)
    with pytest.raises(TypeError, match="not one string"):
        EnqueueCapture("default")
    assert task_path(add) == "tests.testapp.handlers.add" and task_path("a.b") == "a.b"


# -- run_until_empty ---------------------------------------------------------------------------------


def test_run_until_empty_runs_inside_the_test_transaction_and_counts_the_ends(settings: Any) -> None:
    # A backoff no slow machine outlives between the two drains (the default, 0.5-1 s, came due once
    # in CI beside a loaded machine's benchmarks: "nothing due" found the retry due).
    settings.LEASING_TASKS = {"BACKOFF_BASE": 60.0, "BACKOFF_MAX": 600.0}
    assert connection.in_atomic_block  # the test's own transaction: nothing here is committed
    ok = Task.objects.enqueue(P + "record", args=["one"]).id
    flaky = Task.objects.enqueue("tests.testapp.handlers.fail_until", args=[2]).id
    dead = Task.objects.enqueue(P + "fail_always", max_attempts=1).id
    result = h.send_welcome.enqueue("c@example.com")

    drained = run_until_empty()

    assert (drained.succeeded, drained.retried, drained.failed, drained.attempts) == (2, 1, 1, 4)
    rows = {t.id: t for t in Task.objects.filter(pk__in=[ok, flaky, dead, int(result.id)])}
    assert rows[ok].status == TaskStatus.SUCCESSFUL and rows[ok].return_value == "one"
    assert rows[ok].attempts == 1 and rows[ok].worker_ids[0].startswith("inline:")
    assert Effect.objects.filter(task_id=ok, phase="one", attempt=1).count() == 1
    # The retry waits for its backoff, as on a worker; the error entry is the worker's.
    assert rows[flaky].status == TaskStatus.READY and rows[flaky].failures == 1
    assert rows[flaky].errors[0]["message"] == "attempt 1 fails on purpose"
    assert Task.objects.filter(pk=flaky, run_after__gt=Now() + dt.timedelta(seconds=25)).exists()
    assert rows[dead].status == TaskStatus.FAILED
    assert rows[dead].errors[0]["exception_class_path"] == "builtins.ValueError"
    result.refresh()
    assert result.status.name == "SUCCESSFUL" and result.return_value == "sent to c@example.com"
    assert run_until_empty() == Drained()  # nothing due

    drained = run_until_empty(with_scheduled=True)
    assert (drained.succeeded, drained.task_ids) == (1, (flaky,))
    flaky_row = Task.objects.get(pk=flaky)
    assert (flaky_row.status, flaky_row.attempts, flaky_row.return_value) == (
        TaskStatus.SUCCESSFUL,
        2,
        "succeeded on attempt 2",
    )


def test_with_scheduled_runs_deferred_tasks_and_only_the_named_queues_run() -> None:
    import datetime as dt

    later = Task.objects.enqueue(
        P + "record", args=["later"], run_after=dt.datetime(2999, 1, 1, tzinfo=dt.timezone.utc)
    ).id
    other = Task.objects.enqueue(P + "record", args=["other"], queue="other").id
    assert run_until_empty(["default"]) == Drained()
    assert run_until_empty(["default"], with_scheduled=True).task_ids == (later,)
    assert Task.objects.get(pk=other).status == TaskStatus.READY
    assert run_until_empty().task_ids == (other,)
    with pytest.raises(TypeError, match="not one string"):
        run_until_empty("default")


def test_a_queue_a_handler_enqueues_into_is_run_in_the_same_call() -> None:
    first = Task.objects.enqueue(P + "hop", args=["elsewhere"]).id
    drained = run_until_empty()
    hopped = Task.objects.get(pk=first).return_value
    assert drained.task_ids == (first, hopped) and drained.succeeded == 2
    assert Task.objects.get(pk=hopped).queue == "elsewhere"


def test_workflow_steps_run_in_the_same_call() -> None:
    flow = chain(step(add, 1, 2), step(add, 10), step("tests.testapp.handlers.echo")).enqueue()
    drained = run_until_empty()
    assert drained.task_ids == tuple(flow.task_ids) and drained.succeeded == 3
    assert Task.objects.get(pk=flow.task_ids[-1]).return_value == 13  # each step got the last one's value


def test_a_handler_that_breaks_a_statement_leaves_the_test_transaction_usable() -> None:
    broken = Task.objects.enqueue(P + "write_then_break", args=["dup"]).id
    caught = Task.objects.enqueue(P + "catch_integrity_error", args=["dup2"]).id
    drained = run_until_empty()
    assert (drained.retried, drained.succeeded) == (1, 1)
    row = Task.objects.get(pk=broken)  # the test can still query: its transaction is not aborted
    assert row.errors[0]["exception_class_path"] == "django.db.utils.IntegrityError"
    assert not Once.objects.filter(key="dup").exists()  # the failed handler's writes are rolled back
    assert Task.objects.get(pk=caught).return_value == "duplicate caught"
    assert Once.objects.filter(key="dup2").count() == 1  # a handler that recovered keeps its writes


def test_checkpoints_async_handlers_and_timeouts_inline() -> None:
    resumed = Task.objects.enqueue(P + "checkpointing").id
    coroutine = Task.objects.enqueue(P + "async_record", args=["async"]).id
    slow = Task.objects.enqueue(P + "record", args=["slow"], timeout=1e-6, max_attempts=1).id
    drained = run_until_empty(with_scheduled=True)
    assert drained.succeeded == 2 and drained.failed == 1 and drained.retried == 1
    assert Task.objects.get(pk=resumed).return_value == {"progress": {"step": 1}, "attempt": 2}
    row = Task.objects.get(pk=coroutine)
    assert (row.return_value, row.progress) == ("async", {"label": "async"})
    timed_out = Task.objects.get(pk=slow)
    assert timed_out.status == TaskStatus.FAILED
    assert timed_out.errors[-1]["exception_class_path"] == f"{TaskTimeout.__module__}.{TaskTimeout.__qualname__}"


def test_a_paused_queue_is_left_alone() -> None:
    task_id = Task.objects.enqueue(P + "record", args=["paused"], queue="held").id
    QueueControl.objects.pause("held")
    assert run_until_empty() == Drained()
    assert Task.objects.get(pk=task_id).status == TaskStatus.READY


def test_a_task_that_enqueues_itself_forever_stops_at_the_limit() -> None:
    Task.objects.enqueue(P + "forever")
    with pytest.raises(RunLimitReached, match="after 25 attempts") as stopped:
        run_until_empty(limit=25)
    assert stopped.value.drained.succeeded == 25
    # The claim it did not run went back uncharged: nothing is left RUNNING.
    assert not Task.objects.running().exists()
    assert Task.objects.filter(task_path=P + "forever", status=TaskStatus.READY).count() == 1
    with pytest.raises(ValueError, match="limit"):
        run_until_empty(limit=0)


def test_django_tasks_signals_are_sent_in_order() -> None:
    seen: list[tuple[str, str]] = []

    def receiver(name: str) -> Any:
        def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
            seen.append((name, task_result.status.name))

        return receive

    receivers = [(task_enqueued, receiver("enqueued")), (task_started, receiver("started"))]
    receivers.append((task_finished, receiver("finished")))
    for signal, receive in receivers:
        signal.connect(receive)
    try:
        add.enqueue(1, 1)
        run_until_empty()
        with eager_tasks():
            add.enqueue(2, 2)
    finally:
        for signal, receive in receivers:
            signal.disconnect(receive)
    expected = [("enqueued", "READY"), ("started", "RUNNING"), ("finished", "SUCCESSFUL")]
    assert seen == expected * 2


# -- eager mode ----------------------------------------------------------------------------------------


def test_eager_mode_runs_every_kind_of_enqueue_at_once() -> None:
    with eager_tasks() as run:
        plain = Task.objects.enqueue(P + "record", args=["now"]).id
        assert Task.objects.get(pk=plain).status == TaskStatus.SUCCESSFUL  # before the next line runs
        result = add.enqueue(4, 5)
        result.refresh()
        assert result.status.name == "SUCCESSFUL" and result.return_value == 9
        bulk = Task.objects.bulk_enqueue(P + "record", [{"label": "b1"}, {"label": "b2"}])
        flow = chain(step(add, 1, 1), step(add, 1)).enqueue()
        deferred = Task.objects.enqueue(P + "record", args=["deferred"], run_after=_far_future()).id
    ids = [plain, int(result.id), *bulk, *flow.task_ids, deferred]
    assert set(Task.objects.filter(pk__in=ids).values_list("status", flat=True)) == {TaskStatus.SUCCESSFUL}
    assert Task.objects.get(pk=flow.task_ids[-1]).return_value == 3
    assert run.drained.succeeded == len(ids) and run.drained.attempts == len(ids)
    # Outside the block, an enqueue only enqueues.
    later = Task.objects.enqueue(P + "record", args=["later"]).id
    assert Task.objects.get(pk=later).status == TaskStatus.READY


def test_eager_mode_retries_at_once_and_stores_the_failure() -> None:
    with eager_tasks() as run:
        flaky = fail_until.__module__ + ".fail_until"
        recovered = Task.objects.enqueue(flaky, args=[3], max_attempts=5).id
        dead = Task.objects.enqueue(P + "fail_always", args=["x"], max_attempts=2).id
    assert Task.objects.get(pk=recovered).attempts == 3
    row = Task.objects.get(pk=dead)
    assert (row.status, row.attempts, len(row.errors)) == (TaskStatus.FAILED, 2, 2)
    assert row.errors[-1]["message"] == "fails on purpose x"
    assert (run.drained.succeeded, run.drained.retried, run.drained.failed) == (1, 3, 1)


def test_tasks_a_handler_enqueues_run_after_it_and_a_loop_is_stopped() -> None:
    with eager_tasks() as run:
        parent = Task.objects.enqueue(P + "fan_out", args=[3]).id
        children = Task.objects.get(pk=parent).return_value
        assert run.drained.task_ids == (parent, *children)  # the parent first: tasks never nest
        with pytest.raises(RunLimitReached, match="ran 10 attempts") as stopped, eager_tasks(limit=10):
            Task.objects.enqueue(P + "forever")
    assert stopped.value.drained.succeeded == 10
    assert not Task.objects.running().exists()
    assert Effect.objects.filter(task_id__in=children).count() == 3


@pytest.mark.django_db(transaction=True)
def test_eager_mode_belongs_to_the_thread_that_entered_it() -> None:
    found: list[str] = []

    def elsewhere() -> None:
        try:
            task_id = Task.objects.enqueue(P + "record", args=["elsewhere"]).id
            found.append(Task.objects.get(pk=task_id).status)
        finally:
            connection.close()

    with eager_tasks():
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join(30)
        mine = Task.objects.enqueue(P + "record", args=["mine"]).id
    assert found == [TaskStatus.READY]
    assert Task.objects.get(pk=mine).status == TaskStatus.SUCCESSFUL


def test_eager_mode_leaves_a_snoozed_task_waiting() -> None:
    with eager_tasks() as run:
        task_id = Task.objects.enqueue("tests.testapp.outcome_handlers.snooze_times", args=[1, 60]).id
    row = Task.objects.get(pk=task_id)
    assert (row.status, row.snoozes, run.drained.snoozed) == (TaskStatus.READY, 1, 1)
    assert run_until_empty(with_scheduled=True).succeeded == 1


def _far_future() -> Any:
    import datetime as dt

    return dt.datetime(2999, 1, 1, tzinfo=dt.timezone.utc)


# -- several databases -----------------------------------------------------------------------------------


@pytest.mark.django_db(databases=["default", "second"])
def test_the_capture_reads_every_database_and_runs_go_where_the_queue_lives(settings: Any) -> None:
    settings.LEASING_TASKS = {"QUEUE_DATABASES": {"reports": "second"}}
    capture = EnqueueCapture()
    assert capture.databases == ("default", "second")
    far = Task.objects.enqueue(P + "record", args=["far"], queue="reports")
    near = Task.objects.enqueue(P + "record", args=["near"])
    assert far.database == "second"
    assert [t.args for t in capture.tasks] == [["near"], ["far"]]  # by database, then oldest first
    capture.assert_enqueued(h.record, args=["far"], queue="reports", count=1)
    assert run_until_empty().task_ids == (near.id,)  # default's queues
    assert run_until_empty(using="second").task_ids == (far.id,)
    assert Task.objects.using("second").get(pk=far.id).return_value == "far"
    with eager_tasks() as run:
        eager = Task.objects.enqueue(P + "record", args=["eager far"], queue="reports")
    assert Task.objects.using("second").get(pk=eager.id).status == TaskStatus.SUCCESSFUL
    assert run.drained.task_ids == (eager.id,)
