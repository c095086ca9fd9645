"""Child tasks a task waits for (tasks/steps.py ``spawn``, ``wait_for_task``; issue 58): the parent
enqueues its child once (a step), suspends unheld until the child ends, and resumes with what the
child returned, or with how it ended. Whatever ends the child (its worker, a cancel, a bulk cancel)
stores its outcome for the parent in the same statement (the trigger of migration 0041), and makes
the parent due there and then, or at the next recovery round when the parent's row was busy.

Verdicts are states, counts and orders: the parent READY and snoozed while its child waits, one child
per spawn whatever the attempts, the steps around the wait run once."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import Client
from django.utils import timezone

from tasks.exceptions import ChildTaskFailed, ChildTaskTimeout, Snooze
from tasks.maintenance.recovery import recover_once, wake_for_events
from tasks.models import Task, TaskEvent, TaskStep
from tasks.runtime import _set_current
from tasks.steps import spawn, wait_for_task
from tasks.testing.inline import run_until_empty
from tasks.workflows import step as child_step
from tests.db.test_durable_events import attempt_again
from tests.db.test_steps import attempt
from tests.factories import StaffFactory
from tests.helpers import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "steps"
H = "tests.testapp.handlers."


@pytest.fixture
def task_id() -> int:
    return Task.objects.enqueue(H + "noop", queue=QUEUE).id


@pytest.fixture
def worker(settings: Any) -> Iterator[Any]:
    from tasks.worker.process import Worker
    from tests.helpers import worker_in_thread

    # One slot of each kind, and each parent's child of its own kind (a sync child for a sync parent,
    # an async one for an async parent): the child can run only once its parent has suspended and
    # given the slot up.
    running = Worker(
        concurrency=1,
        async_concurrency=1,
        ttl=5,
        poll_interval=0.05,
        install_signal_handlers=False,
        worker_id="children",
    )
    with worker_in_thread(running):
        yield running


def finished(task_id: int) -> Task:
    return wait_until(
        lambda: Task.objects.filter(pk=task_id, status__in=["SUCCESSFUL", "FAILED", "CANCELLED"]).first(),
        60,
        what=f"task {task_id} to end",
    )


@pytest.mark.parametrize(
    ("path", "child_path", "child_kwargs"),
    [(H + "parent_of", H + "add", {"a": 2, "b": 3}), (H + "async_parent_of", H + "async_double", {"n": 2.5})],
)
def test_a_parent_suspends_until_its_child_ends_and_resumes_with_its_result(
    worker: Any, path: str, child_path: str, child_kwargs: dict[str, Any]
) -> None:
    parent = Task.objects.enqueue(path, kwargs={"child": child_path, "child_kwargs": child_kwargs}).id
    task = finished(parent)
    [child] = Task.objects.filter(awaited_by=parent)
    assert (task.status, task.return_value) == ("SUCCESSFUL", {"child": child.id, "result": 5})
    assert (child.status, child.return_value) == ("SUCCESSFUL", 5)
    # It gave its one slot up for its child (a snooze, not an attempt charged), and ran each step once.
    assert (task.attempts, task.snoozes, task.failures) == (1, 1, 0)
    phases = sorted(Effect.objects.filter(task_id=parent).values_list("phase", flat=True))
    assert phases in (["after-child", "before-child"], ["aafter-child", "abefore-child"])
    assert [s.name for s in TaskStep.objects.filter(task_id=parent)] == [
        "before",
        f"spawn:{child_path}",
        f"wait:task:{child.id}",
        f"event:task:{child.id}",
        "after",
    ]
    # The child's page names its parent; the parent's lists the wait among its steps.
    staff = Client()
    staff.force_login(StaffFactory.create())
    page = staff.get(f"/dashboard/tasks/{child.id}/").content.decode()
    assert f'id="task-spawned-by"><a href="/dashboard/tasks/{parent}/"' in page
    parent_page = staff.get(f"/dashboard/tasks/{parent}/").content.decode()
    assert all(f'<tr data-step="{n}">' in parent_page for n in range(5))
    assert 'id="task-spawned-by"' not in parent_page


def test_a_parent_waits_for_several_children_in_turn_waking_at_most_once_for_each(worker: Any) -> None:
    sums = [[1, 2], [3, 4], [5, 6], [7, 8]]
    parent = Task.objects.enqueue(H + "parent_of_many", kwargs={"sums": sums}).id
    task = finished(parent)
    children = list(Task.objects.filter(awaited_by=parent).order_by("id"))
    assert (task.status, task.return_value) == ("SUCCESSFUL", [3, 7, 11, 15])
    assert [c.return_value for c in children] == [3, 7, 11, 15], "one child per spawn, each run once"
    # One worker slot: the children run only while the parent is suspended; it suspends for a child
    # only when that child has not ended yet, and is never charged an attempt for it.
    assert task.attempts == 1 and 1 <= task.snoozes <= len(sums)
    assert [s.name for s in TaskStep.objects.filter(task_id=parent)][len(sums) :] == [
        name for c in children for name in (f"wait:task:{c.id}", f"event:task:{c.id}")
    ]


def test_a_child_that_fails_for_good_raises_in_its_parent_with_its_error(worker: Any) -> None:
    parent = Task.objects.enqueue(
        H + "parent_of", kwargs={"child": H + "explode", "django_task": True, "child_options": {"max_attempts": 1}}
    ).id
    task = finished(parent)
    [child] = Task.objects.filter(awaited_by=parent)
    assert child.status == "FAILED"
    assert task.return_value == {"child": child.id, "status": "FAILED", "error": "builtins.KeyError"}


def test_cancelling_a_waiting_child_wakes_its_parent_with_the_cancel(worker: Any) -> None:
    # The child goes to a queue no worker serves: it waits until the operator cancels it.
    parent = Task.objects.enqueue(H + "parent_of", kwargs={"child": H + "noop", "child_options": {"queue": "idle"}}).id
    wait_until(Task.objects.filter(pk=parent, status="READY", snoozes=1).exists, 60, what="the parent to suspend")
    [child] = Task.objects.filter(awaited_by=parent).values_list("id", flat=True)
    assert Task.objects.filter(pk=child).cancel() == 1
    task = finished(parent)
    assert task.return_value == {"child": child, "status": "CANCELLED", "error": None}
    assert TaskEvent.objects.get(task_id=parent, name=f"task:{child}").delivered, "woken by the cancel itself"


def test_a_wait_past_its_timeout_raises_in_the_parent_and_the_child_goes_on(worker: Any) -> None:
    parent = Task.objects.enqueue(
        H + "parent_of", kwargs={"child": H + "noop", "child_options": {"queue": "idle"}, "timeout": 0.2}
    ).id
    task = finished(parent)
    [child] = Task.objects.filter(awaited_by=parent)
    assert task.return_value == {"child": child.id, "timed_out": True}
    assert child.status == "READY", "only the wait ended"
    assert Task.objects.filter(pk=child.id).cancel() == 1
    assert not TaskEvent.objects.filter(task_id=parent).exists(), "a parent that has ended reads no more events"


def test_a_spawn_is_a_step_a_later_attempt_gets_the_same_child_and_its_outcome(task_id: int, current: None) -> None:
    parent = attempt(task_id, "w1")
    _set_current(parent)
    child = spawn(child_step(H + "add", 1, 1).options(queue="kids"))
    assert Task.objects.get(pk=child).awaited_by == task_id
    with pytest.raises(Snooze):
        wait_for_task(child)
    # The child ends while its parent still runs (it looked, found nothing, and is about to snooze):
    # nothing to wake, so the event waits undelivered for the recovery round.
    assert run_until_empty(["kids"]).task_ids == (child,)
    _set_current(parent)
    event = TaskEvent.objects.get(task_id=task_id)
    assert (event.name, event.payload, event.delivered) == (
        f"task:{child}",
        {"status": "SUCCESSFUL", "result": 2, "error": None},
        False,
    )
    later = timezone.now() + dt.timedelta(hours=1)
    Task.objects.filter(pk=task_id).update(status="READY", run_after=later, snoozes=1)  # the snooze landed
    assert recover_once().woken_for_events == [task_id]
    # The next attempt spawns nothing new and gets the child's result; so does the one after.
    _set_current(attempt_again(task_id))
    assert spawn(child_step(H + "add", 1, 1).options(queue="kids")) == child
    assert wait_for_task(child) == 2
    _set_current(attempt_again(task_id, "w3"))
    assert (spawn(child_step(H + "add", 1, 1).options(queue="kids")), wait_for_task(child)) == (child, 2)
    assert Task.objects.filter(awaited_by=task_id).count() == 1


def test_a_child_that_ended_before_the_wait_is_returned_at_once(task_id: int, current: None) -> None:
    parent = attempt(task_id, "w1")
    _set_current(parent)
    child = spawn(child_step(H + "explode").options(queue="kids", max_attempts=1))
    assert run_until_empty(["kids"]).failed == 1
    _set_current(parent)
    with pytest.raises(ChildTaskFailed) as failed:
        wait_for_task(str(child))
    assert (failed.value.task_id, failed.value.status) == (child, "FAILED")
    assert failed.value.error and failed.value.error["exception_class_path"] == "builtins.KeyError"


def test_a_timeout_is_stored_and_raised_again_by_every_later_attempt(task_id: int, current: None) -> None:
    _set_current(attempt(task_id, "w1"))
    child = spawn(child_step(H + "noop").options(queue="idle"))
    with pytest.raises(ChildTaskTimeout):
        wait_for_task(child, timeout=0)
    Task.objects.filter(pk=child).cancel()
    _set_current(attempt_again(task_id))
    spawn(child_step(H + "noop").options(queue="idle"))
    with pytest.raises(ChildTaskTimeout):
        wait_for_task(child, timeout=0)


def test_a_parent_waits_only_for_a_child_it_spawned(task_id: int, current: None) -> None:
    other = Task.objects.enqueue(H + "noop", queue="idle").id
    _set_current(attempt(task_id, "w1"))
    for wrong in (other, str(other), 0, -1, True, "x", None, 1.5):
        with pytest.raises(ValueError, match="spawn"):
            wait_for_task(wrong)
    assert not TaskStep.objects.filter(task_id=task_id).exists(), "a refused wait records nothing"
    with pytest.raises(TypeError):
        spawn(child_step(H + "noop"), 1)


def test_a_child_bound_to_another_parent_is_refused_and_the_step_leaves_nothing(task_id: int, current: None) -> None:
    from tasks.steps import step as durable_step

    first = Task.objects.enqueue(H + "noop", queue=QUEUE).id
    _set_current(attempt(first, "w0"))
    child = spawn(child_step(H + "noop").options(queue="idle"))
    _set_current(None)
    _set_current(attempt(task_id, "w1"))
    with pytest.raises(ValueError, match="reports to another task"):
        durable_step("takeover", _takeover, child)  # what a spawn does after an enqueue its dedup key folded
    assert Task.objects.get(pk=child).awaited_by == first
    assert not TaskStep.objects.filter(task_id=task_id).exists()


def _takeover(child: int) -> int:
    from django.db import connection

    from tasks.lifecycle import statements as sql
    from tasks.runtime import current_task

    with connection.cursor() as cursor:
        cursor.execute(sql.SPAWN_BIND_SQL, {"child": child, "parent": current_task().id})
        if cursor.fetchone() is None:
            raise ValueError(f"task {child} reports to another task")
    return child


def suspended_parent_of_an_idle_child(task_id: int) -> tuple[int, dt.datetime]:
    """``task_id``'s attempt spawns a child no worker serves and suspends on it; the snooze lands."""
    _set_current(attempt(task_id, "w1"))
    child = spawn(child_step(H + "noop").options(queue="idle"))
    with pytest.raises(Snooze):
        wait_for_task(child)
    _set_current(None)
    later = timezone.now() + dt.timedelta(hours=1)
    Task.objects.filter(pk=task_id).update(status="READY", run_after=later, snoozes=1, holder=None)
    return child, later


@pytest.mark.parametrize("how", ["cancel", "finish"])
def test_the_statement_that_ends_a_child_makes_its_suspended_parent_due(task_id: int, current: None, how: str) -> None:
    child, later = suspended_parent_of_an_idle_child(task_id)
    if how == "cancel":
        assert Task.objects.filter(pk=child).cancel() == 1
    else:
        assert run_until_empty(["idle"]).task_ids == (child,)
    assert Task.objects.get(pk=task_id).run_after <= timezone.now() < later
    event = TaskEvent.objects.get(task_id=task_id)
    assert event.delivered, "woken by the child's end, not left for the recovery round"
    status = "CANCELLED" if how == "cancel" else "SUCCESSFUL"
    assert event.payload["status"] == status
    assert wake_for_events() == [], "nothing left to wake"


def test_a_child_ending_while_another_session_holds_its_parent_does_not_wait_for_it(
    task_id: int, current: None
) -> None:
    """The trigger takes its parent's row with SKIP LOCKED: a finish or a cancel of the child never waits
    for a lock on the parent (it would deadlock with a statement locking the two the other way). The
    parent, held meanwhile, is woken by the recovery round."""
    child, later = suspended_parent_of_an_idle_child(task_id)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic(using="default"):
                Task.objects.select_for_update().filter(pk=task_id).exists()
                holding.set()
                release.wait(60)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(60)
        with connections["default"].cursor() as cursor:
            cursor.execute("SET lock_timeout = '30s'")  # a wait for the held row would fail the cancel
        assert Task.objects.filter(pk=child).cancel() == 1
        assert not TaskEvent.objects.get(task_id=task_id).delivered
    finally:
        release.set()
        holder.join(60)
        with connections["default"].cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    assert Task.objects.get(pk=task_id).run_after == later, "not woken while held"
    assert wake_for_events() == [task_id]
    assert Task.objects.get(pk=task_id).run_after <= timezone.now()
    assert TaskEvent.objects.get(task_id=task_id).delivered


def test_the_how_to_s_invoice_waits_for_its_child_and_mails_it_once(worker: Any) -> None:
    """docs/howto/durable-steps.md's invoice, as written, on a real worker: the parent spawns the
    render on another queue and suspends; the child runs and the parent mails its result. A second
    run of the same parent task (cancelled child) answers with the cancel."""
    import re
    import sys
    import types

    from tests.helpers import ROOT

    page = ROOT / "docs" / "howto" / "durable-steps.md"
    pattern = r"<!-- tested: tests/db/test_child_tasks.py[^>]*-->\n```python\n(.*?)```"
    [block] = re.findall(pattern, page.read_text(), re.S)
    mailed: list[tuple[int, str]] = []
    module = types.ModuleType("billing.tasks")
    module.__dict__.update(mail_invoice=lambda order_id, pdf: mailed.append((order_id, pdf)))
    exec(compile(block, str(page), "exec"), module.__dict__)
    package = types.ModuleType("billing")
    package.__path__ = []
    package.tasks = module  # type: ignore[attr-defined]
    sys.modules.update({"billing": package, "billing.tasks": module})
    try:
        parent = Task.objects.enqueue("billing.tasks.send_invoice", args=[7]).id
        wait_until(Task.objects.filter(pk=parent, status="READY", snoozes=1).exists, 60, what="the parent to wait")
        [child] = Task.objects.filter(awaited_by=parent)
        assert (child.queue, child.task_path, child.args) == ("pdf", "billing.tasks.render_invoice", [7])
        run_until_empty(["pdf"])  # the worker serves "default" only: the pdf queue's worker, inline
        assert finished(parent).return_value == "sent"
        assert mailed == [(7, "invoices/7.pdf")]
        other = Task.objects.enqueue("billing.tasks.send_invoice", args=[8]).id
        wait_until(Task.objects.filter(pk=other, status="READY", snoozes=1).exists, 60, what="the second parent")
        Task.objects.filter(awaited_by=other).cancel()
        assert finished(other).return_value == "no invoice: cancelled"
        assert mailed == [(7, "invoices/7.pdf")]
    finally:
        sys.modules.pop("billing.tasks", None)
        sys.modules.pop("billing", None)


def test_one_cancel_of_a_parent_and_its_child_together_ends_both_and_leaves_nothing_to_wake(
    task_id: int, current: None
) -> None:
    """An operator's cancel (or a bulk one) of both at once: the child's trigger runs after the
    statement has cancelled the parent too (AFTER ROW triggers fire at the statement's end, whichever
    row it updated first), so no outcome is stored for a parent that will never read it, and the
    recovery round has nothing to wake."""
    child, _later = suspended_parent_of_an_idle_child(task_id)
    assert Task.objects.filter(pk__in=[task_id, child]).cancel() == 2
    assert set(Task.objects.filter(pk__in=[task_id, child]).values_list("status", flat=True)) == {"CANCELLED"}
    assert not TaskEvent.objects.filter(task_id=task_id).exists()
    assert wake_for_events() == []


@pytest.mark.parametrize("gone", ["cancelled", "deleted"])
def test_a_child_that_ends_after_its_parent_ended_stores_nothing_for_it(task_id: int, current: None, gone: str) -> None:
    """A parent an operator cancelled (and deleted) while its child still runs: the child's end must
    not fail, and leaves no event row for a task that will never read one (a deleted parent's row would
    otherwise outlive it)."""
    child, _later = suspended_parent_of_an_idle_child(task_id)
    assert Task.objects.filter(pk=task_id).cancel() == 1
    if gone == "deleted":
        assert Task.objects.filter(pk=task_id).delete_finished() == 1
        assert not Task.objects.filter(pk=task_id).exists()
    assert run_until_empty(["idle"]).task_ids == (child,)
    assert Task.objects.get(pk=child).status == "SUCCESSFUL"
    assert not TaskEvent.objects.exists()
    assert wake_for_events() == []


def test_no_send_can_forge_a_child_s_outcome(task_id: int, client: Any, api_token: None, current: None) -> None:
    """``task:<id>`` events are stored by a child's end only: a send under such a name (Python, the
    JSON API, a workflow send) is refused and stores nothing, and wait_for_event does not read one."""
    from tasks.steps import send_event, send_workflow_event, wait_for_event
    from tests.helpers.api import Api

    _set_current(attempt(task_id, "w1"))
    child = spawn(child_step(H + "noop").options(queue="idle"))
    with pytest.raises(ValueError, match="child task's outcome"):
        send_event(task_id, f"task:{child}", {"status": "SUCCESSFUL", "result": "forged"})
    with pytest.raises(ValueError, match="child task's outcome"):
        send_workflow_event(1, f"task:{child}")
    status, body = Api(client).call("POST", f"/api/tasks/{task_id}/events", {"name": f"task:{child}"})
    assert status == 400 and "child task's outcome" in str(body), body
    with pytest.raises(ValueError, match="child task's outcome"):
        wait_for_event(f"task:{child}")
    assert not TaskEvent.objects.exists()
    assert [s.name for s in TaskStep.objects.filter(task_id=task_id)] == [f"spawn:{H}noop"]
