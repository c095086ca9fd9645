"""Durable events (issue 58) in races: sends racing snoozes, cancels and recovery; what a send wakes;
keyed, paused and fair queues."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.utils import timezone

from tasks.exceptions import Snooze
from tasks.lifecycle.values import Failure
from tasks.maintenance.recovery import recover_once, wake_for_events
from tasks.models import Task, TaskEvent
from tasks.runtime import _set_current
from tasks.steps import send_event, wait_for_event
from tests.db.test_steps import attempt
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "steps"


def suspended_waiting(event: str = "paid", timeout: float | None = 3600, **enqueue: Any) -> int:
    """A task whose attempt looked for ``event``, found none and snoozed (as the worker records it)."""
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE, **enqueue).id
    execution = attempt(task_id, "w1")
    _set_current(execution)
    try:
        with pytest.raises(Snooze) as snoozed:
            wait_for_event(event, timeout=timeout)
    finally:
        _set_current(None)
    failure = Failure(
        task_id, execution.token, "tasks.exceptions.Snooze", "", kind="snooze", delay=snoozed.value.seconds
    )
    assert Task.objects.fail(failure, "w1") is not None
    return task_id


def listener() -> psycopg.Connection[Any]:
    params = connection.get_connection_params()
    raw = psycopg.connect(**params, autocommit=True)
    raw.execute("LISTEN leasing_tasks")
    return raw


def notified(raw: psycopg.Connection[Any], timeout: float = 5.0) -> list[str]:
    return [n.payload for n in raw.notifies(timeout=timeout, stop_after=1)]


# -- 1. the send does not wake idle workers (no NOTIFY) ----------------------------------------------


def test_a_send_that_makes_a_waiting_task_due_notifies_idle_workers(current: None) -> None:
    """retry_now of a snoozed task sends NOTIFY leasing_tasks (an idle worker claims at once);
    a send_event that makes a snoozed task due must do the same, else the task waits a poll interval."""
    control = suspended_waiting()
    waiting = suspended_waiting()
    raw = listener()
    try:
        assert Task.objects.filter(pk=control).retry_now() == 1
        assert notified(raw) == [QUEUE], "control: retry_now notifies"
        assert send_event(waiting, "paid", {"ok": True})
        assert Task.objects.get(pk=waiting).run_after <= timezone.now()
        assert TaskEvent.objects.get(task_id=waiting).delivered
        assert notified(raw) == [QUEUE], "send_event made the task due but no worker was notified"
    finally:
        raw.close()


def test_the_recovery_round_s_wake_for_an_event_notifies_idle_workers(current: None) -> None:
    waiting = suspended_waiting()
    Task.objects.filter(pk=waiting).update(status="RUNNING")  # the event comes while it runs
    assert send_event(waiting, "paid")
    Task.objects.filter(pk=waiting).update(status="READY")  # then its snooze lands
    raw = listener()
    try:
        assert wake_for_events() == [waiting]
        assert notified(raw) == [QUEUE], "woken by the recovery round but no worker was notified"
    finally:
        raw.close()


# -- 2. a send wakes tasks that do not wait for it ----------------------------------------------------


def test_an_event_sent_to_a_task_scheduled_for_tomorrow_does_not_run_it_today() -> None:
    tomorrow = timezone.now() + dt.timedelta(days=1)
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE, run_after=tomorrow).id
    assert send_event(task_id, "paid", 1), "an early event is kept"
    assert Task.objects.get(pk=task_id).run_after == tomorrow, "the send moved the task's scheduled start to now"


def test_an_event_does_not_cut_a_failed_attempt_s_retry_backoff(current: None) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE, max_attempts=5).id
    execution = attempt(task_id, "w1")
    failure = Failure(task_id, execution.token, "builtins.ValueError", "boom", kind="fail", delay=3600)
    assert Task.objects.fail(failure, "w1") is not None
    backoff = Task.objects.get(pk=task_id).run_after
    assert backoff > timezone.now() + dt.timedelta(minutes=50)
    assert send_event(task_id, "later", 1)
    assert Task.objects.get(pk=task_id).run_after == backoff, "the send cut the retry's backoff"


# -- 3. the lost-wakeup window: the send racing the snooze's write ------------------------------------


def test_a_send_blocked_behind_the_snooze_s_write_wakes_the_task_once_it_lands(current: None) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    execution = attempt(task_id, "w1")
    _set_current(execution)
    with pytest.raises(Snooze) as snoozed:
        wait_for_event("paid", timeout=3600)
    _set_current(None)
    failure = Failure(
        task_id, execution.token, "tasks.exceptions.Snooze", "", kind="snooze", delay=snoozed.value.seconds
    )
    # The snooze's statement holds the row (uncommitted) while the send comes: the send waits for it
    # (its share lock on the task's row), then finds the task waiting for the event and wakes it.
    with transaction.atomic():
        assert Task.objects.fail(failure, "w1") is not None
        sender = OnItsOwnConnection(lambda: send_event(task_id, "paid", "x"))
        sender.start()
        sender.ready.wait(30)
        wait_until(lambda: waits_for_a_lock(sender.pid), 60, what="the send to wait for the snooze's commit")
    assert sender.outcome() is True
    assert TaskEvent.objects.get(task_id=task_id).delivered, "woken by the send itself"
    assert Task.objects.get(pk=task_id).run_after <= timezone.now(), "lost wakeup"


def test_a_send_while_running_then_snooze_then_recovery_round_racing_the_snooze(current: None) -> None:
    """The recovery round runs while the snooze's write is in flight (uncommitted): it must not mark the
    event delivered without waking the task."""
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    execution = attempt(task_id, "w1")
    _set_current(execution)
    with pytest.raises(Snooze) as snoozed:
        wait_for_event("paid", timeout=3600)
    _set_current(None)
    assert send_event(task_id, "paid", "x")  # RUNNING: undelivered
    failure = Failure(
        task_id, execution.token, "tasks.exceptions.Snooze", "", kind="snooze", delay=snoozed.value.seconds
    )
    with transaction.atomic():
        assert Task.objects.fail(failure, "w1") is not None
        sweeper = OnItsOwnConnection(wake_for_events)
        sweeper.start()
        first = sweeper.outcome()
    assert first == []
    assert not TaskEvent.objects.get(task_id=task_id).delivered
    assert wake_for_events() == [task_id]
    assert Task.objects.get(pk=task_id).run_after <= timezone.now()


def test_a_send_racing_a_cancel_is_refused_or_the_task_stays_cancelled(current: None) -> None:
    task_id = suspended_waiting()
    with transaction.atomic():
        assert Task.objects.filter(pk=task_id).cancel() == 1
        sender = OnItsOwnConnection(lambda: send_event(task_id, "paid", "x"))
        sender.start()
        sender.ready.wait(30)
        wait_until(lambda: waits_for_a_lock(sender.pid), 60, what="the send to wait for the cancel's row lock")
    try:
        result = sender.outcome()
    except Exception as exc:  # TaskError: refused
        result = exc
    task = Task.objects.get(pk=task_id)
    assert task.status == "CANCELLED"
    # Report what happened: a stored event for a cancelled task (send returned True) is the linearised
    # "sent before the cancel"; fine either way as long as nothing revived the task.
    print("send racing cancel ->", result, list(TaskEvent.objects.values_list("task_id", "delivered")))


# -- 4. timeout semantics --------------------------------------------------------------------------------


def test_an_event_sent_after_the_wait_s_deadline_is_not_returned_by_the_resumed_attempt(current: None) -> None:
    task_id = suspended_waiting(timeout=0.5)
    deadline = Task.objects.get(pk=task_id).run_after
    wait_until(lambda: timezone.now() > deadline + dt.timedelta(seconds=0.2), 30, what="the deadline to pass")
    assert send_event(task_id, "paid", "late")  # sent after the deadline
    Task.objects.filter(pk=task_id).update(run_after=timezone.now() - dt.timedelta(seconds=1))
    _set_current(attempt(task_id, "w2"))
    got = wait_for_event("paid", timeout=0.5)
    assert got is None, f"the wait timed out at {deadline} but the resumed attempt got {got!r}, sent after it"


# -- 5. a zombie inside the wait's event step holds the event row locked ---------------------------------

import threading  # noqa: E402

from tasks.exceptions import TaskLeaseLost  # noqa: E402
from tasks.steps import _look_for, step  # noqa: E402
from tests.db.test_steps import take_away  # noqa: E402


def zombie_in_the_event_step(task_id: int) -> tuple[OnItsOwnConnection, threading.Event]:
    """Attempt A reaches the wait after its event was sent while it ran (undelivered), takes it inside
    the wait's second step (EVENT_TAKEN_SQL: the event row updated, uncommitted) and freezes there (a
    SIGSTOP, a GC pause, a partition) until ``release`` is set."""
    execution = attempt(task_id, "zombie")
    assert send_event(task_id, "go", {"v": 1})  # RUNNING: stored undelivered
    assert not TaskEvent.objects.get(task_id=task_id).delivered
    inside, release = threading.Event(), threading.Event()

    def frozen_look(name: str, deadline: Any) -> Any:
        found = _look_for(name, deadline)
        inside.set()
        release.wait(120)
        return found

    def run() -> Any:
        _set_current(execution)
        try:
            step("wait:go", lambda: None)  # the wait's deadline (none)
            return step("event:go", frozen_look, "go", None)  # exactly what wait_for_event runs
        finally:
            _set_current(None)

    zombie = OnItsOwnConnection(run)
    zombie.start()
    assert inside.wait(60)
    return zombie, release


def test_a_frozen_attempt_inside_the_event_step_does_not_stall_the_recovery_round(current: None) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    zombie, release = zombie_in_the_event_step(task_id)
    try:
        take_away(task_id)  # its lease lapsed: recovery requeued it (READY), the zombie still frozen
        sweeper = OnItsOwnConnection(lambda: recover_once())
        sweeper.start()
        sweeper.ready.wait(30)
        blocked = wait_until(
            lambda: (not sweeper.is_alive() and "done") or (waits_for_a_lock(sweeper.pid) and "blocked"),
            60,
            what="the recovery round to end or block",
        )
        assert blocked == "done", (
            "the recovery round (every task's recovery) waits on the event row a frozen zombie holds locked"
        )
    finally:
        release.set()
        with pytest.raises(TaskLeaseLost):
            zombie.outcome()
    sweeper.outcome()


def test_a_frozen_attempt_inside_the_event_step_does_not_stall_the_live_attempt(current: None) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    zombie, release = zombie_in_the_event_step(task_id)
    try:
        take_away(task_id)
        live = attempt(task_id, "live")

        def run() -> Any:
            _set_current(live)
            try:
                return wait_for_event("go")
            finally:
                _set_current(None)

        resumed = OnItsOwnConnection(run)
        resumed.start()
        resumed.ready.wait(30)
        state = wait_until(
            lambda: (not resumed.is_alive() and "done") or (waits_for_a_lock(resumed.pid) and "blocked"),
            60,
            what="the live attempt's wait to end or block",
        )
        assert state == "done", "the live attempt's wait is blocked by the frozen zombie's uncommitted EVENT_TAKEN"
    finally:
        release.set()
        with pytest.raises(TaskLeaseLost):
            zombie.outcome()
    assert resumed.outcome() == {"v": 1}
