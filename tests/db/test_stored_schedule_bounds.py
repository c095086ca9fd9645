"""A stored schedule the API accepts must be one the scheduler can run: values that pass the type
checks but not the arithmetic or the columns (an interval whose next slot lies past the year 9999,
a max_attempts beyond the task column, a timeout beyond what POST /api/tasks allows) are refused
with a 400 naming the field, and a row that holds one anyway (written before the bound, or by hand)
is left out by the scheduler with a warning while every other schedule goes on.

Found attacking issue 40 on Python 3.10, Django 5.2 and PostgreSQL 15: ``{"interval": 1e12}`` was
stored (201), and the leader's next round raised OverflowError out of the scheduler thread, which
released the lease and ended; each replica that took over died the same way, so one API call
stopped every schedule, the settings' ones included. ``max_attempts: 2**40`` failed each slot
statement (integer out of range) and with it the rest of every round."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from leasing.models import Lease
from tasks.maintenance.scheduler import SCHEDULER_LEASE, Scheduler, ScheduleState, SlotWriter, database_now
from tasks.models import ScheduleRun, StoredSchedule
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("schedule_api_settings")]


POISON = [
    ({"interval": 1e12}, "interval"),  # 31,700 years: the next slot is past datetime.max
    ({"interval": 10**20}, "interval"),
    ({"max_attempts": 2**40}, "max_attempts"),  # beyond tasks_task.max_attempts (integer)
    ({"max_attempts": 1001}, "max_attempts"),  # beyond what POST /api/tasks takes
    ({"timeout": 1e300}, "timeout"),  # beyond what POST /api/tasks takes (MAX_TTL)
]


@pytest.mark.parametrize(("extra", "field"), POISON)
def test_a_value_the_scheduler_cannot_run_is_a_400_and_writes_nothing(
    api: Api, extra: dict[str, Any], field: str
) -> None:
    status, reply = api.call("POST", "/api/schedules", {"name": "a-poison", "task": NOOP, "interval": 1, **extra})
    assert status == 400, reply
    assert reply["field"] == field
    assert not StoredSchedule.objects.exists()
    # An edit to it is refused the same way.
    assert api.call("POST", "/api/schedules", {"name": "a-poison", "task": NOOP, "interval": 1})[0] == 201
    before = list(StoredSchedule.objects.values_list("entry", "revision"))
    status, reply = api.call("PATCH", "/api/schedules/a-poison", extra)
    assert status == 400 and reply["field"] == field, reply
    assert list(StoredSchedule.objects.values_list("entry", "revision")) == before


@pytest.mark.parametrize(("extra", "field"), POISON)
def test_a_stored_row_holding_one_is_left_out_and_the_others_run(api: Api, extra: dict[str, Any], field: str) -> None:
    # Sorted before the witness: a round that fails on it would not reach the witness.
    assert api.call("POST", "/api/schedules", {"name": "a-poison", "task": NOOP, "interval": 1})[0] == 201
    assert api.call("POST", "/api/schedules", {"name": "witness", "task": NOOP, "interval": 1})[0] == 201
    earlier = database_now() - dt.timedelta(seconds=3.5)
    StoredSchedule.objects.update(effective_from=earlier)
    # As a row written before the bound existed, or by hand: not through the validator.
    row = StoredSchedule.objects.get(name="a-poison")
    StoredSchedule.objects.filter(name="a-poison").update(entry={**row.entry, **extra}, revision=row.revision + 1)
    assert set(extra) <= set(StoredSchedule.objects.get(name="a-poison").entry)

    grant = Lease.objects.acquire(SCHEDULER_LEASE, "sched-a", 30)
    assert grant is not None
    writer = SlotWriter(holder="sched-a", token=grant.token)
    scheduler = Scheduler(schedules={}, ttl=30)
    states: dict[str, ScheduleState] = {}
    scheduler.refresh(writer, states)
    scheduler.round(writer, states)

    assert "a-poison" not in scheduler.schedules
    assert ScheduleRun.objects.filter(schedule="witness").count() == 1  # catch-up "last": the newest slot
    assert not ScheduleRun.objects.filter(schedule="a-poison").exists()


@pytest.mark.parametrize(
    "fields",
    [
        '"queue": "q\\ud800"',
        '"fair_key": "k\\udfff"',
        '"kwargs": {"\\ud800": 1}',
        '"kwargs": {"\\u0000": 1}',
        '"args": ["\\ud800"]',
        '"interval": null, "cron": "0 * * * *", "timezone": "\\ud800"',
        '"interval": null, "cron": "0 * * * \\ud800"',
        '"name": "t\\u00e2che"',
        '"task": "tests.testapp.handlers.noop\\ud800"',
    ],
)
def test_text_postgresql_cannot_store_is_a_400(api: Api, fields: str) -> None:
    # Raw JSON: a lone surrogate cannot be sent through json.dumps of a Python str unescaped.
    raw = f'{{"name": "tick", "task": "{NOOP}", "interval": 1, {fields}}}'
    status, reply = api.call("POST", "/api/schedules", raw=raw)
    assert status == 400, reply
    assert not StoredSchedule.objects.exists()
