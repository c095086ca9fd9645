"""Schedules from settings: validation, and their slots (interval arithmetic, cron through cronsim)."""

from __future__ import annotations

import datetime as dt
from itertools import islice
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ImproperlyConfigured

from tasks.maintenance.retention import parse_duration, retention_policy
from tasks.maintenance.schedule_specs import ScheduleSpec, build_spec, load_schedules

UTC = dt.timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")


def spec(**entry: Any) -> ScheduleSpec:
    return build_spec("s", {"task": "tests.testapp.handlers.noop", **entry})


def at(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, micro: int = 0, tz: Any = UTC
) -> dt.datetime:
    return dt.datetime(year, month, day, hour, minute, second, micro, tzinfo=tz)


def local(slots: list[dt.datetime]) -> list[str]:
    return [slot.astimezone(BERLIN).isoformat() for slot in slots]


# -- interval --------------------------------------------------------------------------------------


def test_interval_slots_are_multiples_of_the_interval_since_the_epoch() -> None:
    every_five = spec(interval=5)
    slots = list(islice(every_five.slots_after(at(2026, 1, 1, 0, 0, 3)), 3))
    assert slots == [at(2026, 1, 1, 0, 0, 5), at(2026, 1, 1, 0, 0, 10), at(2026, 1, 1, 0, 0, 15)]
    # Strictly after: a slot is never its own successor.
    assert every_five.next_slot(at(2026, 1, 1, 0, 0, 5)) == at(2026, 1, 1, 0, 0, 10)


def test_fractional_intervals_keep_exact_slots() -> None:
    slots = list(islice(spec(interval=0.25).slots_after(at(2026, 1, 1)), 4))
    assert [s.microsecond for s in slots] == [250_000, 500_000, 750_000, 0]


def test_latest_due_counts_the_missed_slots_exactly() -> None:
    every_second = spec(interval=1)
    newest, before, exact = every_second.latest_due(at(2026, 1, 1, 0, 0, 0), at(2026, 1, 1, 0, 0, 10, 500))
    assert (newest, before, exact) == (at(2026, 1, 1, 0, 0, 10), 9, True)
    assert every_second.latest_due(at(2026, 1, 1, 0, 0, 10), at(2026, 1, 1, 0, 0, 10, 999_999)) == (None, 0, True)


# -- cron (cronsim: Debian cron's semantics) -------------------------------------------------------


def test_day_of_month_and_day_of_week_are_ored_when_both_are_restricted() -> None:
    first_or_monday = spec(cron="0 12 1 * MON", timezone="UTC")
    days = [slot.date() for slot in islice(first_or_monday.slots_after(at(2026, 5, 31)), 4)]
    # 2026-06-01 is a Monday; then the Mondays; 2026-07-01 (a Wednesday) as the 1st of the month.
    assert days == [dt.date(2026, 6, 1), dt.date(2026, 6, 8), dt.date(2026, 6, 15), dt.date(2026, 6, 22)]
    assert dt.date(2026, 7, 1) in [s.date() for s in islice(first_or_monday.slots_after(at(2026, 6, 25)), 3)]
    # A star in either field makes it AND, as in cron.
    mondays = spec(cron="0 12 * * MON", timezone="UTC")
    assert all(s.weekday() == 0 for s in islice(mondays.slots_after(at(2026, 5, 31)), 5))


def test_a_job_in_the_skipped_spring_hour_runs_once_at_the_end_of_the_gap() -> None:
    # Europe/Berlin, 2026-03-29: 02:00 -> 03:00. Debian cron runs a 02:30 job at 03:00 that day.
    daily = spec(cron="30 2 * * *", timezone="Europe/Berlin")
    slots = list(islice(daily.slots_after(at(2026, 3, 28, 12, tz=BERLIN)), 3))
    assert local(slots) == ["2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00", "2026-03-31T02:30:00+02:00"]


def test_a_fixed_time_job_in_the_repeated_autumn_hour_runs_once() -> None:
    # Europe/Berlin, 2026-10-25: 03:00 -> 02:00. A 02:30 job runs once, not twice.
    daily = spec(cron="30 2 * * *", timezone="Europe/Berlin")
    slots = list(islice(daily.slots_after(at(2026, 10, 24, 12, tz=BERLIN)), 3))
    assert local(slots) == ["2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00", "2026-10-27T02:30:00+01:00"]


def test_a_wildcard_job_runs_in_both_copies_of_the_repeated_hour_and_slots_only_move_forward() -> None:
    every_20 = spec(cron="*/20 * * * *", timezone="Europe/Berlin")
    slots = list(islice(every_20.slots_after(at(2026, 10, 25, 1, 10, tz=BERLIN)), 8))
    assert local(slots)[3:] == [
        "2026-10-25T02:20:00+02:00",
        "2026-10-25T02:40:00+02:00",
        "2026-10-25T02:00:00+01:00",
        "2026-10-25T02:20:00+01:00",
        "2026-10-25T02:40:00+01:00",
    ]
    assert slots == sorted(slots) and len(set(slots)) == len(slots)


def test_fixed_time_slots_started_inside_the_repeated_hour_never_go_back() -> None:
    # 02:10 CET (the second 02:10 of the night): cronsim walks the wall clock and would answer
    # 02:40 CEST, which is earlier; the slot iterator passes over it.
    twice_an_hour = spec(cron="10,40 2 * * *", timezone="Europe/Berlin")
    start = dt.datetime(2026, 10, 25, 2, 10, tzinfo=BERLIN, fold=1)
    slots = list(islice(twice_an_hour.slots_after(start.astimezone(UTC)), 2))
    assert all(slot > start for slot in slots)
    assert slots == sorted(slots)


def test_latest_due_of_a_cron_schedule_after_a_long_backlog() -> None:
    every_minute = spec(cron="* * * * *", timezone="UTC")
    newest, before, exact = every_minute.latest_due(at(2026, 1, 1), at(2026, 1, 1, 0, 10, 30))
    assert (newest, before, exact) == (at(2026, 1, 1, 0, 10), 9, True)
    # Beyond the count cap (10,000 slots) the newest slot comes from walking backwards.
    newest, before, exact = every_minute.latest_due(at(2026, 1, 1), at(2026, 3, 1, 7, 5, 59))
    assert newest == at(2026, 3, 1, 7, 5) and not exact and before >= 10_000


# -- validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"interval": 5, "cron": "* * * * *"}, "exactly one of cron"),
        ({}, "exactly one of cron"),
        ({"cron": "61 * * * *"}, "invalid cron expression"),
        ({"cron": "* * * *"}, "invalid cron expression"),
        ({"interval": 0}, "interval must be at least"),
        ({"interval": True}, "interval must be a number"),
        ({"interval": 5, "timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"interval": 5, "catch_up": "sometimes"}, "catch_up must be one of"),
        ({"interval": 5, "kwargs": {"x": float("nan")}}, "storable as JSON"),
        ({"interval": 5, "args": "abc"}, "args must be a list"),
        ({"interval": 5, "priority": 101}, "priority must be"),
        ({"interval": 5, "queue": ""}, "queue must be"),
        ({"interval": 5, "max_attempts": 0}, "max_attempts"),
        ({"interval": 5, "timeout": -1}, "timeout must be more than 0"),
        ({"interval": 5, "every": 5}, "unknown key(s) every"),
        ({"interval": 5, "task": "tests.testapp.handlers.nope"}, "cannot be imported"),
        ({"interval": 5, "task": 42}, "import path or a django.tasks Task"),
    ],
)
def test_invalid_schedules_are_refused_with_the_reason(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ImproperlyConfigured) as raised:
        build_spec("s", {"task": "tests.testapp.handlers.noop", **entry})
    assert message in str(raised.value)
    assert 'SCHEDULES"]["s"]' in str(raised.value)


def test_bad_schedule_names_are_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match="schedule name"):
        build_spec("no spaces", {"task": "tests.testapp.handlers.noop", "interval": 1})


def test_a_django_task_gives_its_path_queue_and_priority(settings: Any) -> None:
    from tests.testapp.handlers import add

    by_object = build_spec("add", {"task": add, "interval": 60, "kwargs": {"a": 1, "b": 2}})
    by_path = build_spec("add", {"task": "tests.testapp.handlers.add", "interval": 60, "kwargs": {"a": 1, "b": 2}})
    assert by_object == by_path
    assert by_object.task_path == add.module_path
    assert (by_object.queue, by_object.priority) == (add.queue_name, add.priority)
    assert build_spec("add", {"task": add, "interval": 60, "queue": "mail"}).queue == "mail"


def test_the_settings_are_read_and_the_system_check_reports_errors(settings: Any) -> None:
    from tasks.checks import check_task_settings

    settings.LEASING_TASKS = {"SCHEDULES": {"tick": {"task": "tests.testapp.handlers.noop", "interval": 2}}}
    assert list(load_schedules()) == ["tick"]
    assert check_task_settings() == []
    settings.LEASING_TASKS = {"SCHEDULES": {"tick": {"task": "tests.testapp.handlers.noop", "cron": "bad"}}}
    errors = check_task_settings()
    assert [e.id for e in errors] == ["tasks.E101"] and "invalid cron expression" in errors[0].msg
    settings.LEASING_TASKS = {"RETENTION": {"SUCCESSFUL": "forever"}}
    errors = check_task_settings()
    assert [e.id for e in errors] == ["tasks.E102"] and "SUCCESSFUL" in errors[0].msg


# -- retention durations -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("7d", 604800), ("12h", 43200), ("1d12h", 129600), ("90m", 5400), ("30s", 30), ("2w", 1209600), ("0", 0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text).total_seconds() == seconds


@pytest.mark.parametrize("bad", ["", "7 days", "d7", "-1d", "1y", -5, None, True])
def test_bad_durations_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"duration|negative"):
        parse_duration(bad)


def test_retention_policy_merges_over_the_defaults(settings: Any) -> None:
    settings.LEASING_TASKS = {"RETENTION": {"SUCCESSFUL": "1h", "FAILED": None}}
    policy = retention_policy()
    assert policy is not None
    assert policy["SUCCESSFUL"] == dt.timedelta(hours=1)
    assert policy["FAILED"] is None  # kept forever
    assert policy["LEASES"] == dt.timedelta(days=1)  # the default
    settings.LEASING_TASKS = {"RETENTION": None}
    assert retention_policy() is None
    settings.LEASING_TASKS = {"RETENTION": {"RUNNING": "1d"}}
    with pytest.raises(ValueError, match="unknown"):
        retention_policy()
