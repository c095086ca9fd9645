"""The demo's backfilled history (tasks/demo/backfill.py): a day of the hourly rollup, marked as demo
data, that the rollup keeps and that never hides or overwrites a real count."""

from __future__ import annotations

import pytest

from tasks.demo import backfill
from tasks.maintenance.history import count_hour, roll_up_hours
from tasks.models import ActivityHour, ActivityHourMark
from tasks.web.history import history
from tests.db.test_history import finished, hour_ago

pytestmark = pytest.mark.django_db


def hours_with_data(queue: str | None = None) -> list[object]:
    return [hour.start for hour in history(hours=48, queue=queue).series if hour.totals.finished]


def test_a_day_of_demo_history_shows_on_the_page_and_the_rollup_keeps_it() -> None:
    assert backfill.backfill_history(24, seed=1) == 24
    assert len(hours_with_data()) == 24
    assert set(ActivityHour.objects.values_list("queue", flat=True)) == {backfill.QUEUE}
    assert ActivityHourMark.objects.filter(hour__gte=hour_ago(24)).count() == 24
    rows = ActivityHour.objects.count()
    # The recovery leader's round finds those hours counted (their marks) and leaves them be: without
    # a mark it would recount them from the tasks, find none, and delete the demo's rows.
    roll_up_hours()
    assert ActivityHour.objects.count() == rows
    assert len(hours_with_data(backfill.QUEUE)) == 24
    # A second demo start adds nothing.
    assert backfill.backfill_history(24, seed=2) == 0
    assert ActivityHour.objects.count() == rows


def test_real_counts_are_never_overwritten_or_hidden() -> None:
    real = hour_ago(3)
    finished(real, queue="default")  # a task finished in that hour, not counted yet
    counted = hour_ago(5)
    count_hour(counted)  # counted by the rollup (nothing in it)
    assert backfill.backfill_history(24, seed=1) == 22
    assert not ActivityHour.objects.filter(hour__in=[real, counted]).exists()
    # The real hour is counted as usual by the next round, in its own queue.
    assert real in roll_up_hours().counted
    assert list(ActivityHour.objects.filter(hour=real).values_list("queue", "succeeded")) == [("default", 1)]
    assert real in hours_with_data("default")
