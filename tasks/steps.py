"""Durable steps: a part of a task that, once done, is never done again, and whose database writes
commit only while its attempt still holds the task.

.. code-block:: python

    from tasks.steps import step, step_key

    def fulfil(order_id):
        charge = step("charge", charge_card, order_id)       # once per task, whatever the retries
        step("ship", create_shipment, order_id, charge["id"])
        return charge["id"]

    def charge_card(order_id):
        order = Order.objects.select_for_update().get(pk=order_id)
        order.charged = True
        order.save()                                          # commits with the step, or not at all
        return payments.charge(order.total, idempotency_key=step_key())   # the callee deduplicates

``step(name, fn, *args, **kwargs)`` calls ``fn`` inside one transaction of its own and stores what it
returned (JSON, as a task's result is) in that same transaction, fenced by the attempt's lease
(tasks/lifecycle/steps.py): the transaction commits only if this attempt still holds the task, on the
database clock, under the task row's lock. A worker paused past its TTL that wakes up inside a step has
the whole step rolled back, its writes included, and gets :class:`~tasks.exceptions.TaskLeaseLost`.
A later attempt of the task (a retry, a crash recovered, an operator's requeue) gets the stored result
of each step it calls again, in order, without running it; the first step with no stored result runs.

Steps are recorded by position: the n-th step called. An attempt whose handler calls a different name
where an earlier attempt recorded one raises :class:`~tasks.exceptions.StepMismatch` naming both (a
code change the stored results do not fit), never returns the wrong step's result.

What a step does outside the database cannot be rolled back: ``step_key()`` inside a step is a key
stable across every attempt of that step (the task, the step's position and name), for the callee to
deduplicate with (a payment provider's idempotency key). What a step returns is what every later
attempt gets: its JSON round trip, on the first run too.

``sleep(seconds)`` and ``sleep_until(when)`` are durable sleeps: the first attempt to reach one stores
its wake time (the database clock plus the sleep) as a step and ends as a snooze until then, holding
no worker slot, connection or lease while the task waits (it is not charged as an attempt). The
attempt that runs at the wake time gets every step before the sleep back stored, passes the sleep,
and goes on. A sleep is a step: its place in the sequence is checked as a step's is.

``wait_for_event(name, timeout=...)`` suspends the task the same way until ``send_event(task_id, name,
payload)`` (this module, the JSON API's ``POST /api/tasks/<id>/events``) stores an event of that name
for it, and returns its payload (None at the timeout). The first payload sent under a name is the one
every attempt gets; the wait is two steps (its deadline, then what it got).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import connections, transaction
from django.utils import timezone

from tasks import tracing
from tasks.exceptions import ChildTaskFailed, ChildTaskTimeout, Snooze, StepMismatch, TaskError, TaskLeaseLost
from tasks.lifecycle import statements as sql
from tasks.lifecycle.policy import MAX_DELAY, checked_delay
from tasks.lifecycle.storable import storable_json
from tasks.lifecycle.values import CHILD_EVENT, MAX_EVENT_NAME, event_name
from tasks.runtime import Execution, current_task

T = TypeVar("T")

#: The longest step name tasks_taskstep stores.
MAX_NAME = 200


@dataclass(frozen=True, slots=True)
class StepRun:
    """The step running in this thread or coroutine."""

    task_id: int
    position: int
    name: str

    @property
    def key(self) -> str:
        return f"task-{self.task_id}-step-{self.position}-{self.name}"


_running: ContextVar[StepRun | None] = ContextVar("tasks_running_step", default=None)


def step_key() -> str:
    """Inside a step: a key the same in every attempt of this step of this task, and in no other
    step's, for a call outside the database to be deduplicated by its callee."""
    run = _running.get()
    if run is None:
        raise RuntimeError("step_key() is only available inside a step (tasks.steps.step)")
    return run.key


def _stored(execution: Execution) -> dict[int, tuple[str, str | None]]:
    """The task's stored steps (position -> name, result as JSON text), read once per attempt."""
    if execution.steps is None:
        with connections[execution.using].cursor() as cursor:
            cursor.execute(sql.STEPS_READ_SQL, {"id": execution.id})
            execution.steps = {position: (name, result) for position, name, result, _attempt in cursor.fetchall()}
    return execution.steps


def step(name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as the task's next step, once per task: see the module's text."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or "\x00" in name:
        raise ValueError(f"a step's name is a non-empty string of at most {MAX_NAME} characters: {name!r}")
    execution = current_task()
    connection = connections[execution.using]
    if connection.in_atomic_block:
        raise RuntimeError(
            f"step {name!r} was called inside an open transaction: a step commits its own (its commit is"
            " the fence), so it cannot be part of another"
        )
    stored = _stored(execution)
    position = execution.step_position
    execution.step_position += 1
    with tracing.stepping(execution, name, position) as traced:
        recorded = stored.get(position)
        if recorded is not None:
            recorded_name, text = recorded
            if recorded_name != name:
                raise StepMismatch(
                    f"task {execution.id} calls step {name!r} at position {position}, where an earlier attempt"
                    f" recorded step {recorded_name!r}: the code changed under a task in flight"
                )
            traced["outcome"] = "replayed"
            return None if text is None else json.loads(text)
        execution.check()
        started_at = timezone.now()
        running = _running.set(StepRun(execution.id, position, name))
        try:
            with transaction.atomic(using=execution.using):
                text = storable_json(fn(*args, **kwargs))
                with connection.cursor() as cursor:
                    cursor.execute(
                        sql.STEP_RECORD_SQL,
                        {
                            "id": execution.id,
                            "worker": execution.worker_id,
                            "token": execution.token,
                            "attempt": execution.attempt,
                            "position": position,
                            "name": name,
                            "result": text,
                            "started_at": started_at,
                        },
                    )
                    fenced = cursor.fetchone() is not None
                if not fenced:
                    traced["outcome"] = "lease_lost"
                    execution.mark_lost(f"step {name!r} found the task no longer held: its writes were rolled back")
                    raise TaskLeaseLost(
                        f"task {execution.id} is no longer held by this worker: step {name!r} was rolled back"
                    )
        except _NotYet:
            traced["outcome"] = "waiting"
            raise
        finally:
            _running.reset(running)
        stored[position] = (name, text)
        return json.loads(text)


async def astep(name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """:func:`step` from an ``async def`` handler: ``fn`` is a plain function (its database writes are
    Django's synchronous ORM), run with its fenced transaction on the worker's small pool of database
    threads, as ``acheckpoint`` is."""
    from asgiref.sync import sync_to_async
    from django.db import close_old_connections

    def run() -> Any:
        try:
            return step(name, fn, *args, **kwargs)
        except Exception:
            close_old_connections()  # a pool thread's broken connection is replaced next time
            raise

    return await sync_to_async(run, thread_sensitive=False)()


# -- re-running from a step (an operator's action) -----------------------------------------------------


def rerun_from_step(task_id: int, position: int, *, using: str | None = None) -> int:
    """Discard the task's stored steps from ``position`` on (its events stay: they were sent) and run
    it again now: a finished task is requeued with a fresh set of attempts (a task the mover took to
    the finished history comes back first), a waiting one is made due; a workflow member AWAITING its
    parents keeps waiting. Returns how many steps were discarded. In one transaction under the task
    row's lock, so no claim or fence comes between: a RUNNING task is refused (its attempt holds its
    steps; cancel it or let it end), as a position past its last step, and a requeue its dedup key
    refuses (TaskError) changes nothing."""
    from tasks.lifecycle.states import FINISHED, WAITING
    from tasks.models import Task, TaskStep

    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise ValueError(f"a step's position is a whole number from 0, not {position!r}")
    manager = Task.objects.db_manager(using) if using else Task.objects
    with transaction.atomic(using=manager.db):
        task = manager.find(task_id)
        if task is None:
            raise Task.DoesNotExist(f"no task with id {task_id}")
        if task.archived:
            manager.restore([task_id])
        status = manager.select_for_update().filter(pk=task_id).values_list("status", flat=True).first()
        if status is None and manager.restore([task_id]):
            # Read in tasks_task, then taken by the mover before the lock: back, and read again.
            status = manager.select_for_update().filter(pk=task_id).values_list("status", flat=True).first()
        if status is None:
            raise Task.DoesNotExist(f"no task with id {task_id}")
        if status == "RUNNING":
            raise TaskError(f"task {task_id} is running: its attempt holds its steps (cancel it, or wait for its end)")
        steps = TaskStep.objects.using(manager.db).filter(task_id=task_id)
        stored = steps.count()
        if position > stored:
            raise ValueError(f"task {task_id} has {stored} stored steps: re-run from one of 0 to {stored}")
        discarded, _ = steps.filter(position__gte=position).delete()
        if status in FINISHED:
            manager.filter(pk=task_id).requeue()
        elif status in WAITING:
            manager.filter(pk=task_id).retry_now()
    return discarded


# -- patch markers ----------------------------------------------------------------------------------


def patched(name: str) -> bool:
    """Whether this run of the task takes a code path a deploy added at this point of its steps::

        if patched("tax-2027"):
            total = step("total", total_with_new_tax, order_id)
        else:
            total = step("total", total_with_old_tax, order_id)

    True for a task that had not reached this point before the deploy (a new task, or one whose
    attempts recorded no step here yet): the marker is recorded as a step (``patch:<name>``) and
    every later attempt takes the same path. False for a task whose earlier attempts recorded another
    step here (they ran the old code past this point): it goes on the old path, and its stored steps
    fit. Once no task from before the deploy is left, the old branch and the marker can go (a task
    that recorded the marker then sees a mismatch: remove both only when none is in flight)."""
    marker = f"patch:{name}"
    if not isinstance(name, str) or not name or len(marker) > MAX_NAME:
        raise ValueError(f"a patch's name is a non-empty string of at most {MAX_NAME - 6} characters: {name!r}")
    execution = current_task()
    recorded = _stored(execution).get(execution.step_position)
    if recorded is not None and recorded[0] != marker:
        return False  # recorded by an attempt that ran the code from before the patch
    step(marker, _true)
    return True


def _true() -> bool:
    return True


# -- durable sleeps ----------------------------------------------------------------------------------


def _seconds(duration: float | dt.timedelta) -> float:
    if isinstance(duration, dt.timedelta):
        duration = duration.total_seconds()
    return checked_delay(duration, what="a durable sleep")


def _wake_at(when: dt.datetime) -> str:
    if not isinstance(when, dt.datetime) or timezone.is_naive(when):
        raise ValueError(f"sleep_until() takes an aware datetime (timezone.now() + ...), not {when!r}")
    # How far ahead, on the database clock the sleep's wake is read by (an application server's
    # clock ahead of it would otherwise let a sleep of more than the bound through).
    with connections[current_task().using].cursor() as cursor:
        cursor.execute(sql.SLEEP_REMAINING_SQL, {"wake": when.isoformat()})
        (ahead,) = cursor.fetchone()
    if ahead > MAX_DELAY:
        raise ValueError(f"sleep_until() wakes at most {MAX_DELAY:g} seconds from now, not at {when.isoformat()}")
    return when.isoformat()


def _wake_after(seconds: float) -> str:
    """Inside the sleep's step: the wake time, on the database clock."""
    with connections[current_task().using].cursor() as cursor:
        cursor.execute(sql.SLEEP_WAKE_SQL, {"seconds": seconds})
        return str(cursor.fetchone()[0].isoformat())


def _suspended(left: float | None) -> Snooze:
    """The snooze that suspends the task for ``left`` seconds (None: until woken), at most a year."""
    return Snooze(MAX_DELAY if left is None else min(left, MAX_DELAY))


def _snooze_until(wake: str) -> None:
    """Snooze the task until ``wake`` (its stored wake time), unless the database clock is past it."""
    with connections[current_task().using].cursor() as cursor:
        cursor.execute(sql.SLEEP_REMAINING_SQL, {"wake": wake})
        (left,) = cursor.fetchone()
    if left > 0:
        raise _suspended(left)


def sleep(duration: float | dt.timedelta, *, name: str = "sleep") -> None:
    """Sleep ``duration`` (seconds or a timedelta, up to a year) without a worker: see the module's
    text. ``name`` tells the sleeps of one task apart on its page and in mismatch errors."""
    _snooze_until(step(name, _wake_after, _seconds(duration)))


def sleep_until(when: dt.datetime, *, name: str = "sleep") -> None:
    """Sleep until ``when`` (an aware datetime) without a worker: a time already past goes on at once."""
    _snooze_until(step(name, _wake_at, when))


async def asleep(duration: float | dt.timedelta, *, name: str = "sleep") -> None:
    """:func:`sleep` from an ``async def`` handler."""
    from asgiref.sync import sync_to_async

    seconds = _seconds(duration)
    wake = await astep(name, _wake_after, seconds)
    await sync_to_async(_snooze_until, thread_sensitive=False)(wake)


async def asleep_until(when: dt.datetime, *, name: str = "sleep") -> None:
    """:func:`sleep_until` from an ``async def`` handler."""
    from asgiref.sync import sync_to_async

    wake = await astep(name, _wake_at, when)
    await sync_to_async(_snooze_until, thread_sensitive=False)(wake)


# -- events --------------------------------------------------------------------------------------------


class _NotYet(Exception):
    """Inside the wait's second step: no event yet, and ``left`` seconds to its deadline (None: none)."""

    def __init__(self, left: float | None) -> None:
        super().__init__(left)
        self.left = left


def _deadline(seconds: float | None) -> str | None:
    """Inside the wait's first step: its deadline on the database clock (None: it waits without one)."""
    return None if seconds is None else _wake_after(seconds)


def _look_for(name: str, deadline: str | None) -> dict[str, Any]:
    """Inside the wait's second step: the event, the timeout, or :class:`_NotYet` (rolls the step back)."""
    execution = current_task()
    with connections[execution.using].cursor() as cursor:
        cursor.execute(sql.EVENT_CHECK_SQL, {"id": execution.id, "name": name, "deadline": deadline})
        text, found, left = cursor.fetchone()
        if found:
            return {"payload": None if text is None else json.loads(text)}
    if left is not None and left <= 0:
        return {"timed_out": True}
    raise _NotYet(left)


def _waited(resolved: dict[str, Any]) -> Any:
    return resolved.get("payload")


def wait_for_event(name: str, *, timeout: float | dt.timedelta | None = None) -> Any:
    """Suspend the task until an event ``name`` is sent to it, and return its payload; None once
    ``timeout`` (seconds or a timedelta, up to a year; None: no deadline) has passed without one."""
    return _wait(event_name(name), timeout)


def _wait(name: str, timeout: float | dt.timedelta | None) -> Any:
    seconds = None if timeout is None else _seconds(timeout)
    deadline = step(f"wait:{name}", _deadline, seconds)
    try:
        return _waited(step(f"event:{name}", _look_for, name, deadline))
    except _NotYet as waiting:
        raise _suspended(waiting.left) from None


async def await_event(name: str, *, timeout: float | dt.timedelta | None = None) -> Any:
    """:func:`wait_for_event` from an ``async def`` handler."""
    return await _await(event_name(name), timeout)


async def _await(name: str, timeout: float | dt.timedelta | None) -> Any:
    seconds = None if timeout is None else _seconds(timeout)
    deadline = await astep(f"wait:{name}", _deadline, seconds)
    try:
        return _waited(await astep(f"event:{name}", _look_for, name, deadline))
    except _NotYet as waiting:
        raise _suspended(waiting.left) from None


def send_event(task_id: int, name: str, payload: Any = None, *, using: str | None = None) -> bool:
    """Send the event ``name`` with ``payload`` (JSON) to an unfinished task: True when it is stored,
    False when one of that name was sent to the task before (the first payload stands). A task that
    waits for it is made due at once. Raises ``Task.DoesNotExist`` for no such task and
    :class:`~tasks.exceptions.TaskError` for a finished one (nothing waits for its events)."""
    from tasks.models import Task

    event_name(name)
    text = storable_json(payload)
    manager = Task.objects.db_manager(using) if using else Task.objects
    with transaction.atomic(using=manager.db), connections[manager.db].cursor() as cursor:
        cursor.execute(sql.EVENT_LOCK_SQL, {"id": task_id})
        cursor.execute(sql.EVENT_SEND_SQL, {"ids": [task_id], "name": name, "payload": text})
        stored = cursor.fetchone() is not None
    if stored:
        return True
    task = manager.find(task_id)
    if task is None:
        raise Task.DoesNotExist(f"no task with id {task_id}")
    if task.archived or task.status in ("SUCCESSFUL", "FAILED", "CANCELLED"):
        raise TaskError(f"task {task_id} is {task.status.lower()}: no event reaches it any more")
    return False


def send_workflow_event(workflow_id: int, name: str, payload: Any = None, *, using: str | None = None) -> list[int]:
    """Send the event ``name`` with ``payload`` (JSON) to every unfinished member of a workflow, as
    :func:`send_event` to each (see :func:`tasks.workflows.send_workflow_event`): the ids of the
    members it was stored for, in id order."""
    from tasks import workflows

    return workflows.send_workflow_event(workflow_id, name, payload, using=using)


# -- child tasks ---------------------------------------------------------------------------------------

#: The prefix of a spawn's step name (``spawn:<the child's task path>``).
SPAWN = "spawn:"


def spawn(task: Any, /, *args: Any, **kwargs: Any) -> int:
    """Enqueue ``task(*args, **kwargs)`` as a child of the running task, once, and return its id.

    ``task``: a django.tasks Task (its options through ``task.using(...)``), an import path, or a
    workflow step with options (``tasks.workflows.step("app.jobs.resize", photo).options(queue="images")``).
    The enqueue is a step: it commits with the step's fenced transaction, so a later attempt gets the
    same child's id back instead of enqueuing another. The child goes in this task's database and
    reports to this task: when it ends, whatever ends it (its worker, a cancel, a bulk operation,
    recovery), its outcome is stored in the same statement for :func:`wait_for_task`."""
    from tasks.workflows import Step

    child = task if isinstance(task, Step) else None
    if child is not None and (args or kwargs):
        raise TypeError("spawn() takes a workflow step's arguments in the step, not after it")
    child = child or Step(task, tuple(args), dict(kwargs))
    path = child.task if isinstance(child.task, str) else getattr(child.task, "module_path", repr(child.task))
    return int(step(f"{SPAWN}{path}"[:MAX_NAME], _enqueue_child, child))


def _enqueue_child(child: Any) -> int:
    """Inside the spawn's step: the child enqueued and bound to the running task, in its transaction."""
    from tasks.compat import Task as DjangoTask
    from tasks.models import Task

    execution = current_task()
    columns, database, django_task, _backend = child.row()
    if database != execution.using:
        raise ValueError(
            f"a spawned task goes in its parent's database ({execution.using!r}): queue {columns['queue']!r}"
            f" routes to {database!r}"
        )
    if isinstance(child.task, DjangoTask):
        task_id = int(str(django_task.enqueue(*child.args, **child.kwargs).id).partition("@")[0])
    else:
        options = {
            key: columns[key]
            for key in ("queue", "priority", "run_after", "max_attempts", "timeout", "concurrency_key")
            if columns[key] is not None
        }
        for key in ("concurrency_limit", "fair_key"):
            if columns[key] is not None:
                options[key] = columns[key]
        if child.rate_key is not None or child.rate_limit is not None:
            options |= {"rate_key": child.rate_key, "rate_limit": child.rate_limit}
        task_id = (
            Task.objects.db_manager(database)
            .enqueue(columns["task_path"], args=columns["args"], kwargs=columns["kwargs"], **options)
            .id
        )
    with connections[database].cursor() as cursor:
        cursor.execute(sql.SPAWN_BIND_SQL, {"child": task_id, "parent": execution.id})
        if cursor.fetchone() is None:
            raise ValueError(
                f"task {task_id} (an existing task of the same dedup or unique key) reports to another task:"
                " a child reports to one parent"
            )
    return task_id


def _spawned(task_id: Any) -> int:
    """The id of a child the running task spawned, from an id or a django.tasks result."""
    raw = getattr(task_id, "id", task_id)
    if isinstance(raw, str) and raw.partition("@")[0].isdigit():
        raw = int(raw.partition("@")[0])
    if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
        raise ValueError(f"wait_for_task() takes the id spawn() returned, not {task_id!r}")
    spawned = {text for name, text in _stored(current_task()).values() if name.startswith(SPAWN)}
    if str(raw) not in spawned:
        raise ValueError(
            f"task {raw} was not spawned by this task: wait_for_task() waits for a child from spawn(),"
            " whose end is reported to its parent"
        )
    return raw


def _child_outcome(child: int, outcome: Any) -> Any:
    if outcome is None:
        raise ChildTaskTimeout(child)
    if outcome.get("status") == "SUCCESSFUL":
        return outcome.get("result")
    raise ChildTaskFailed(child, str(outcome.get("status")), outcome.get("error"))


def wait_for_task(task_id: Any, *, timeout: float | dt.timedelta | None = None) -> Any:
    """Suspend the task until its child ``task_id`` (from :func:`spawn`) ends, and return what the child
    returned; without a worker, a connection or a lease meanwhile, as :func:`wait_for_event`.

    A child that ended FAILED or CANCELLED raises :class:`~tasks.exceptions.ChildTaskFailed` (its status
    and last error); ``timeout`` (seconds or a timedelta, up to a year) passed first raises
    :class:`~tasks.exceptions.ChildTaskTimeout`. The outcome is stored as a step (two steps:
    ``wait:task:<id>``, ``event:task:<id>``): every later attempt gets the same, raised or returned."""
    child = _spawned(task_id)
    return _child_outcome(child, _wait(f"{CHILD_EVENT}{child}", timeout))


async def aspawn(task: Any, /, *args: Any, **kwargs: Any) -> int:
    """:func:`spawn` from an ``async def`` handler."""
    from tasks.workflows import Step

    if isinstance(task, Step) and (args or kwargs):
        raise TypeError("spawn() takes a workflow step's arguments in the step, not after it")
    child = task if isinstance(task, Step) else Step(task, tuple(args), dict(kwargs))
    path = child.task if isinstance(child.task, str) else getattr(child.task, "module_path", repr(child.task))
    return int(await astep(f"{SPAWN}{path}"[:MAX_NAME], _enqueue_child, child))


async def await_task(task_id: Any, *, timeout: float | dt.timedelta | None = None) -> Any:
    """:func:`wait_for_task` from an ``async def`` handler."""
    from asgiref.sync import sync_to_async

    child = await sync_to_async(_spawned, thread_sensitive=False)(task_id)
    return _child_outcome(child, await _await(f"{CHILD_EVENT}{child}", timeout))


__all__ = [
    "CHILD_EVENT",
    "MAX_EVENT_NAME",
    "MAX_NAME",
    "SPAWN",
    "StepRun",
    "asleep",
    "asleep_until",
    "aspawn",
    "astep",
    "await_event",
    "await_task",
    "patched",
    "rerun_from_step",
    "send_event",
    "send_workflow_event",
    "sleep",
    "sleep_until",
    "spawn",
    "step",
    "step_key",
    "wait_for_event",
    "wait_for_task",
]
