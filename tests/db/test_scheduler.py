"""The scheduler's statements and rounds on the real database: slots become tasks exactly once,
catch-up follows the schedule's policy, and a deposed scheduler's writes are refused."""

from __future__ import annotations

import datetime as dt
import itertools
import threading
from typing import Any

import pytest
from django.db import connection

from leasing.models import Lease
from tasks.maintenance.schedule_specs import ScheduleSpec, build_spec
from tasks.maintenance.scheduler import SCHEDULER_LEASE, Deposed, Scheduler, ScheduleState, SlotWriter, database_now
from tasks.models import Schedule, ScheduleRun, Task
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def make_spec(name: str = "tick", **entry: Any) -> ScheduleSpec:
    return build_spec(name, {"task": NOOP, "interval": 1, **entry})


def lead(holder: str = "sched-a", ttl: float = 30, lease: str = SCHEDULER_LEASE) -> SlotWriter:
    grant = Lease.objects.acquire(lease, holder, ttl)
    assert grant is not None
    return SlotWriter(holder=holder, token=grant.token, lease=lease)


def scheduler_for(*specs: ScheduleSpec) -> Scheduler:
    return Scheduler(schedules={s.name: s for s in specs}, ttl=30)


def backdate(name: str, seconds: float) -> dt.datetime:
    """The schedule was first seen ``seconds`` ago (the scheduler was down since)."""
    moment = database_now() - dt.timedelta(seconds=seconds)
    Schedule.objects.filter(name=name).update(baseline_at=moment, last_slot=None)
    return moment


def state_of(name: str) -> ScheduleState:
    row = Schedule.objects.get(name=name)
    return ScheduleState(baseline_at=row.baseline_at, last_slot=row.last_slot)


def slots_between(spec: ScheduleSpec, after: dt.datetime, until: dt.datetime) -> list[dt.datetime]:
    slots: list[dt.datetime] = []
    for slot in spec.slots_after(after):
        if slot > until:
            return slots
        slots.append(slot)
    raise AssertionError("unreachable")


def test_sync_creates_the_row_and_a_new_schedule_starts_after_it_was_first_seen() -> None:
    spec = make_spec(interval=3600)
    writer = lead()
    before = database_now()
    state = writer.sync(spec, before)
    row = Schedule.objects.get(name="tick")
    assert row.baseline_at >= before and row.last_slot is None and state.after == row.baseline_at
    assert row.fence_token == writer.token and row.leader == "sched-a"
    assert row.definition["task"] == NOOP and row.definition["interval"] == 3600
    assert row.next_slot == spec.next_slot(before)
    report = scheduler_for(spec).round(writer, {"tick": state})
    assert report.enqueued == [] and not Task.objects.exists()


def test_catch_up_all_enqueues_every_missed_slot_once_in_order() -> None:
    spec = make_spec(catch_up="all")
    writer = lead()
    writer.sync(spec, database_now())
    baseline = backdate("tick", 10.5)
    scheduler = scheduler_for(spec)
    states = {"tick": state_of("tick")}
    report = scheduler.round(writer, states)
    expected = slots_between(spec, baseline, database_now())  # a slot may have come due since the round
    assert 10 <= len(expected) <= 11
    assert [r.slot for r in report.enqueued] == expected[: len(report.enqueued)]
    assert len(report.enqueued) >= len(expected) - 1
    runs = list(ScheduleRun.objects.filter(schedule="tick").order_by("slot"))
    assert [r.slot for r in runs] == [r.slot for r in report.enqueued]
    tasks = {t.pk: t for t in Task.objects.all()}
    assert sorted(tasks) == sorted(r.task_id for r in runs)
    assert {t.task_path for t in tasks.values()} == {NOOP} and {t.status for t in tasks.values()} == {"READY"}
    assert all(r.token == writer.token for r in runs)
    row = Schedule.objects.get(name="tick")
    assert row.last_slot == runs[-1].slot and row.last_task_id == runs[-1].task_id and row.enqueued == len(runs)

    # The same slots again: nothing new (the row only moves forward).
    again = scheduler.round(writer, {"tick": state_of("tick")})
    assert all(r.slot > runs[-1].slot for r in again.enqueued)
    assert ScheduleRun.objects.count() == Task.objects.count() == len(runs) + len(again.enqueued)


def test_catch_up_last_runs_the_newest_missed_slot_once_and_counts_the_rest() -> None:
    spec = make_spec(catch_up="last", interval=60, kwargs={"k": 1}, queue="cron", priority=7)
    writer = lead()
    writer.sync(spec, database_now())
    backdate("tick", 600)
    report = scheduler_for(spec).round(writer, {"tick": state_of("tick")})
    assert len(report.enqueued) == 1
    result = report.enqueued[0]
    assert 9 <= result.skipped <= 10
    task = Task.objects.get()
    assert (task.pk, task.kwargs, task.queue, task.priority) == (result.task_id, {"k": 1}, "cron", 7)
    row = Schedule.objects.get(name="tick")
    assert (row.enqueued, row.skipped, row.last_slot) == (1, result.skipped, result.slot)
    assert result.slot <= database_now() < result.slot + dt.timedelta(seconds=60)


def test_catch_up_skip_runs_nothing_late_beyond_the_grace_but_moves_on() -> None:
    spec = make_spec(catch_up="skip", interval=3600, grace=0)
    writer = lead()
    writer.sync(spec, database_now())
    backdate("tick", 5 * 3600)
    scheduler = scheduler_for(spec)
    report = scheduler.round(writer, {"tick": state_of("tick")})
    assert report.enqueued == [] and not Task.objects.exists()
    row = Schedule.objects.get(name="tick")
    assert row.skipped in (5, 6) and row.last_slot == report.skipped[0].slot and row.enqueued == 0
    # Within the grace, the newest slot runs (the missed ones before it do not).
    generous = make_spec(catch_up="skip", interval=3600, grace=3600)
    backdate("tick", 5 * 3600)
    report = scheduler_for(generous).round(writer, {"tick": state_of("tick")})
    assert len(report.enqueued) == 1 and Task.objects.count() == 1


def test_a_disabled_schedule_enqueues_nothing() -> None:
    spec = make_spec(enabled=False, catch_up="all")
    writer = lead()
    writer.sync(spec, database_now())
    backdate("tick", 5)
    assert scheduler_for(spec).round(writer, {"tick": state_of("tick")}).enqueued == []
    assert not Task.objects.exists()


def test_a_deposed_scheduler_cannot_enqueue() -> None:
    spec = make_spec(catch_up="all")
    old = lead("sched-a", ttl=30)
    old.sync(spec, database_now())
    backdate("tick", 3)
    Lease.objects.filter(resource=SCHEDULER_LEASE).revoke()  # e.g. it stalled past its TTL
    new = lead("sched-b")
    assert new.token > old.token
    slot = spec.next_slot(Schedule.objects.get(name="tick").baseline_at)
    with pytest.raises(Deposed, match="no longer ours"):
        old.enqueue(spec, slot)
    with pytest.raises(Deposed):
        old.skip(spec, slot, skipped=1)
    with pytest.raises(Deposed):
        old.sync(spec, database_now())
    assert not Task.objects.exists() and not ScheduleRun.objects.exists()
    assert Schedule.objects.get(name="tick").last_slot is None
    # The new leader enqueues the slot; the old one, even if its lease were still live somewhere,
    # meets the fence (next test) and the run row.
    assert new.enqueue(spec, slot) is not None
    assert Task.objects.count() == 1


def test_the_fence_refuses_an_older_token_even_while_its_lease_is_live() -> None:
    spec = make_spec()
    older = lead("sched-a", lease="tasks:scheduler:one")
    newer = lead("sched-b", lease="tasks:scheduler:two")  # a larger token from the same sequence
    newer.sync(spec, database_now())
    slot = spec.next_slot(database_now())
    with pytest.raises(Deposed, match="newer scheduler wrote"):
        older.enqueue(spec, slot)
    assert not Task.objects.exists()
    assert Schedule.objects.get(name="tick").fence_token == newer.token


def test_a_slot_that_has_a_run_is_never_enqueued_again() -> None:
    spec = make_spec()
    writer = lead()
    writer.sync(spec, database_now())
    slot = spec.next_slot(database_now())
    first = writer.enqueue(spec, slot)
    assert first is not None
    # Someone sets the row back by hand: the forward-only check passes, the run row refuses.
    Schedule.objects.filter(name="tick").update(last_slot=None)
    assert writer.enqueue(spec, slot) is None
    assert list(Task.objects.values_list("pk", flat=True)) == [first]
    assert ScheduleRun.objects.get().task_id == first


def test_one_statement_per_slot() -> None:
    spec = make_spec()
    writer = lead()
    writer.sync(spec, database_now())
    slot = spec.next_slot(database_now())
    with connection.execute_wrapper(counter := _Counter()):
        writer.enqueue(spec, slot)
    assert counter.count == 1


class _Counter:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        self.count += 1
        return execute(sql, params, many, context)


def test_the_scheduler_thread_enqueues_due_slots_and_stops() -> None:
    spec = make_spec(interval=0.2, catch_up="all")
    scheduler = scheduler_for(spec)
    thread = threading.Thread(target=scheduler.run)
    thread.start()
    try:
        wait_until(lambda: Task.objects.count() >= 5, 15, what="five slots to be enqueued")
    finally:
        scheduler.stop()
        thread.join(10)
    assert not thread.is_alive()
    runs = list(ScheduleRun.objects.order_by("slot").values_list("slot", flat=True))
    step = dt.timedelta(seconds=0.2)
    assert all(b - a == step for a, b in itertools.pairwise(runs)), "no slot missed or repeated"
    assert Task.objects.count() == len(runs)
    assert not Lease.objects.active().filter(resource=SCHEDULER_LEASE).exists()  # released on stop


def test_run_scheduler_once_and_list(settings: Any) -> None:
    from io import StringIO

    from django.core.management import call_command

    settings.LEASING_TASKS = {"SCHEDULES": {"tick": {"task": NOOP, "interval": 3600}}}
    out = StringIO()
    call_command("run_scheduler", "--once", stdout=out)
    assert "ran one round" in out.getvalue()
    assert Schedule.objects.filter(name="tick").exists()
    out = StringIO()
    call_command("run_scheduler", "--list", stdout=out)
    assert out.getvalue().startswith("tick: tests.testapp.handlers.noop every 3600 s; next ")


@pytest.mark.parametrize("with_scheduler", [True, False])
def test_a_worker_runs_the_scheduler_in_a_thread_unless_told_not_to(settings: Any, with_scheduler: bool) -> None:
    from django.db import connections

    from tasks.worker.process import Worker

    settings.LEASING_TASKS = {"SCHEDULES": {"tick": {"task": NOOP, "interval": 0.2, "catch_up": "all"}}}
    worker = Worker(
        concurrency=2,
        ttl=2,
        poll_interval=0.05,
        recovery=False,
        scheduler=with_scheduler,
        install_signal_handlers=False,
        worker_id="sched-worker",
    )

    def run() -> None:
        try:
            worker.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        if with_scheduler:
            wait_until(lambda: Task.objects.filter(status="SUCCESSFUL").count() >= 3, 20, what="scheduled tasks to run")
            assert Lease.objects.active().get(resource=SCHEDULER_LEASE).holder  # the worker's scheduler leads
        else:
            wait_until(lambda: "heartbeat" in worker.services.names, 10, what="the worker to start")
            assert "scheduler" not in worker.services.names
    finally:
        worker.request_stop()
        worker.request_stop()
        thread.join(30)
    assert not thread.is_alive()
    assert ScheduleRun.objects.exists() is with_scheduler
    assert not Lease.objects.active().filter(resource=SCHEDULER_LEASE).exists()  # released at shutdown
