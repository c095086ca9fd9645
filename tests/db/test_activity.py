"""The per-minute activity rollup (tasks/lifecycle/activity.py): closed minutes are counted once and then read,
late commits are taken in by the final count, the open minutes are counted live, and recoveries are
recorded by the recovery statement itself."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from tasks.lifecycle import activity
from tasks.models import ActivityMinute, Task
from tests.helpers import db_now

pytestmark = pytest.mark.django_db


def finished(count: int, status: str, minutes_ago: float) -> dt.datetime:
    """``count`` tasks that finished ``minutes_ago`` (database clock); returns that moment."""
    at = db_now() - dt.timedelta(minutes=minutes_ago)
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * count)
    Task.objects.filter(pk__in=ids).update(status=status, finished_at=at)
    return at


def minute_of(at: dt.datetime) -> dt.datetime:
    return at.replace(second=0, microsecond=0)


def test_closed_minutes_are_counted_once_and_then_read() -> None:
    at = finished(3, "SUCCESSFUL", 20)
    finished(2, "FAILED", 20)
    finished(4, "SUCCESSFUL", 30.5)
    assert activity.roll_up() >= 2
    row = ActivityMinute.objects.get(minute=minute_of(at))
    assert (row.succeeded, row.failed, row.closed, row.final) == (3, 2, True, True)
    # Every closed minute of the hour has its row now, zeros included: the next call counts nothing.
    assert ActivityMinute.objects.filter(closed=True).count() >= 58
    assert activity.roll_up() <= 1  # nothing, or the one minute that closed meanwhile
    series = activity.last_hour()
    assert sum(series["succeeded"]) == 7
    assert sum(series["failed"]) == 2
    # What is read is the rollup: a task finishing late in a final minute is not counted again.
    finished(5, "SUCCESSFUL", 20)
    assert sum(activity.last_hour()["succeeded"]) == 7


def test_a_provisional_count_is_replaced_by_the_final_one() -> None:
    at = finished(2, "SUCCESSFUL", 15)
    # Counted while its finishes were still committing (provisional: one task seen)...
    ActivityMinute.objects.create(minute=minute_of(at), succeeded=1, closed=True, final=False, recovered=4)
    activity.roll_up()
    row = ActivityMinute.objects.get(minute=minute_of(at))
    assert (row.succeeded, row.final, row.recovered) == (2, True, 4)  # recoveries are left alone
    # ... and a final count is never overwritten.
    ActivityMinute.objects.filter(pk=row.pk).update(succeeded=9)
    activity.roll_up()
    assert ActivityMinute.objects.get(pk=row.pk).succeeded == 9


def test_open_minutes_are_counted_live() -> None:
    at = finished(3, "SUCCESSFUL", 0)
    series = activity.last_hour()
    assert series["succeeded"][-1] + series["succeeded"][-2] == 3  # this minute (or the last, at a boundary)
    assert not ActivityMinute.objects.filter(minute=minute_of(at), closed=True).exists()


def test_old_minutes_are_pruned() -> None:
    old = minute_of(db_now()) - dt.timedelta(days=2)
    ActivityMinute.objects.create(minute=old, succeeded=1, closed=True, final=True)
    assert activity.roll_up() > 0  # pruning comes with the closing of minutes
    assert not ActivityMinute.objects.filter(minute=old).exists()


def test_recoveries_are_recorded_by_the_recovery_statement() -> None:
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 3)
    claimed = Task.objects.claim("w-gone", limit=3, ttl=30, start=True)
    assert {c.id for c in claimed} == set(ids)
    Task.objects.filter(pk__in=ids).update(
        expires_at=timezone.now() - dt.timedelta(seconds=4), renewed_at=timezone.now() - dt.timedelta(seconds=40)
    )
    recovered = Task.objects.recover_expired()
    assert len(recovered) == 3
    assert Task.objects.recover_expired() == []
    stats = activity.recoveries_last_hour()
    assert stats.count == 3
    assert stats.silent_max == pytest.approx(40, abs=5)
    assert stats.silent_avg == pytest.approx(40, abs=5)
    assert stats.delay_max == pytest.approx(4, abs=3)
    assert sum(activity.last_hour()["recovered"]) == 3
