"""A stored schedule deleted and stored again under its name is a new schedule: the scheduler must
not take the new row for the old one it read, whatever happened between two of its reads. It ran
the old definition (the deleted row's kwargs) from the old effective time, when a schedule stored
again started at revision 1 again and so passed the slot statement's check. Revisions now come
from one sequence (migration 0033) and are never given twice; the scheduler compares the row's
``created_at`` too.

Found attacking issue 40 on Python 3.10, Django 5.2 and PostgreSQL 15: an operator's delete and
re-create within one round (a second) of the leader."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from leasing.models import Lease
from tasks.maintenance.scheduler import SCHEDULER_LEASE, Scheduler, ScheduleState, SlotWriter, database_now
from tasks.models import ScheduleRun, StoredSchedule, Task
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("schedule_api_settings")]


def tick(version: int) -> dict[str, Any]:
    return {"name": "tick", "task": NOOP, "interval": 1, "catch_up": "all", "kwargs": {"v": version}}


def test_a_schedule_deleted_and_stored_again_between_two_rounds_runs_only_the_new_definition(api: Api) -> None:
    status, created = api.call("POST", "/api/schedules", tick(1))
    assert status == 201
    StoredSchedule.objects.update(effective_from=database_now() - dt.timedelta(seconds=2.5))
    grant = Lease.objects.acquire(SCHEDULER_LEASE, "sched-a", 30)
    assert grant is not None
    writer = SlotWriter(holder="sched-a", token=grant.token)
    scheduler = Scheduler(schedules={}, ttl=30)
    states: dict[str, ScheduleState] = {}
    scheduler.refresh(writer, states)
    scheduler.round(writer, states)
    old = ScheduleRun.objects.count()
    assert old >= 2

    assert api.call("DELETE", "/api/schedules/tick")[0] == 200
    status, body = api.call("POST", "/api/schedules", tick(2))
    assert status == 201 and body["revision"] > created["revision"]
    stored_again = dt.datetime.fromisoformat(body["effective_from"])
    # Time passes past the new row's start: a slot of the new definition is due.
    StoredSchedule.objects.update(effective_from=stored_again - dt.timedelta(seconds=2.5))
    stored_again -= dt.timedelta(seconds=2.5)

    def next_round() -> list[Any]:
        scheduler.refresh(writer, states)
        return scheduler.round(writer, states).enqueued

    wait_until(next_round, 10, interval=0.05, what="a slot after the schedule was stored again")
    later = list(ScheduleRun.objects.order_by("slot")[old:])
    kwargs = dict(Task.objects.filter(pk__in=[r.task_id for r in later]).values_list("pk", "kwargs"))
    assert [kwargs[r.task_id] for r in later] == [{"v": 2}] * len(later)
    assert all(r.slot > stored_again for r in later)


def test_a_write_made_at_a_deleted_schedules_revision_is_refused_by_the_one_stored_again(api: Api) -> None:
    """An operator's page (or script) read the schedule, someone deleted it and stored it again: the
    write made at the revision read is a 409 and changes nothing, as for any schedule edited since."""
    status, old = api.call("POST", "/api/schedules", tick(1))
    assert status == 201
    assert api.call("DELETE", "/api/schedules/tick")[0] == 200
    status, new = api.call("POST", "/api/schedules", tick(2))
    assert status == 201 and new["revision"] != old["revision"]
    before = list(StoredSchedule.objects.values_list("entry", "revision", "updated_at"))
    for method in ("PUT", "PATCH"):
        status, body = api.call(method, "/api/schedules/tick", {**tick(3), "revision": old["revision"]})
        assert status == 409 and body["field"] == "revision", body
    assert list(StoredSchedule.objects.values_list("entry", "revision", "updated_at")) == before
