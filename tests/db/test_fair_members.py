"""Breaker 32's lost keys: a fair queue's tasks that a workflow (``depends_on``, the builder's
steps) or the scheduler inserts take their turn like any enqueue: the key given, or the shared key
"" (a NULL key is taken only when the keys' turns leave room: tasks/lifecycle/statements.py, the fill)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import ImproperlyConfigured

from leasing.models import Lease
from tasks.maintenance.schedule_specs import build_spec
from tasks.maintenance.scheduler import SCHEDULER_LEASE, Scheduler, ScheduleState, SlotWriter, database_now
from tasks.models import Schedule, Task
from tasks.workflows import chain, group, step
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fair_queues")]


def keys_of(ids: list[int]) -> list[str | None]:
    rows = dict(Task.objects.filter(pk__in=ids).values_list("pk", "fair_key"))
    return [rows[i] for i in ids]


def test_a_task_with_depends_on_keeps_its_key_or_gets_the_shared_one() -> None:
    parent = Task.objects.enqueue(NOOP, queue="fair", fair_key="t1")
    given = Task.objects.enqueue(NOOP, queue="fair", fair_key="t2", depends_on=[parent.id])
    shared = Task.objects.enqueue(NOOP, queue="fair", depends_on=[parent.id])
    plain = Task.objects.enqueue(NOOP, queue="plain", depends_on=[parent.id])
    assert keys_of([parent.id, given.id, shared.id, plain.id]) == ["t1", "t2", "", None]


def test_workflow_steps_of_a_fair_queue_get_their_key_or_the_shared_one() -> None:
    done = group(
        [step(NOOP).options(queue="fair", fair_key="tenant-a"), step(NOOP).options(queue="fair")],
        then=step(NOOP).options(queue="plain"),
    ).enqueue()
    assert keys_of(list(done.task_ids)) == ["tenant-a", "", None]
    done = chain(step(NOOP).options(queue="fair"), step(NOOP).options(queue="fair", fair_key="tenant-b")).enqueue()
    assert keys_of(list(done.task_ids)) == ["", "tenant-b"]


def test_a_workflow_step_with_a_bad_key_is_refused_and_nothing_is_stored() -> None:
    with pytest.raises(ValueError, match="fair_key must not contain NUL"):
        chain(step(NOOP).options(queue="fair"), step(NOOP).options(queue="fair", fair_key="a\x00b")).enqueue()
    assert not Task.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_scheduled_task_of_a_fair_queue_gets_the_schedules_key_or_the_shared_one() -> None:
    specs = [
        build_spec("shared", {"task": NOOP, "interval": 3600, "queue": "fair"}),
        build_spec("tenant", {"task": NOOP, "interval": 3600, "queue": "fair", "fair_key": "tenant-c"}),
        build_spec("plain", {"task": NOOP, "interval": 3600, "queue": "plain"}),
    ]
    grant = Lease.objects.acquire(SCHEDULER_LEASE, "sched", 30)
    assert grant is not None
    writer = SlotWriter(holder="sched", token=grant.token)
    for spec in specs:
        writer.sync(spec, database_now())
    Schedule.objects.update(baseline_at=database_now() - dt.timedelta(hours=1, seconds=1))
    scheduler = Scheduler(schedules={s.name: s for s in specs}, ttl=30)
    states = {row.name: ScheduleState(baseline_at=row.baseline_at, last_slot=None) for row in Schedule.objects.all()}
    report = scheduler.round(writer, states)
    enqueued = {r.schedule: r.task_id for r in report.enqueued if r.task_id is not None}
    assert set(enqueued) == {"shared", "tenant", "plain"}, report
    assert keys_of([enqueued["shared"], enqueued["tenant"], enqueued["plain"]]) == ["", "tenant-c", None]


def test_a_schedule_with_a_bad_key_is_a_configuration_error() -> None:
    with pytest.raises(ImproperlyConfigured, match="fair_key must be a string"):
        build_spec("bad", {"task": NOOP, "interval": 60, "queue": "fair", "fair_key": 7})
