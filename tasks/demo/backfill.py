"""Backfilled history for the demo: the previous day of the hourly rollup, so that a fresh demo's
history page has more than one bar.

Written at demo start through the rollup's own models (:class:`~tasks.models.ActivityHour` and its
:class:`~tasks.models.ActivityHourMark`, tasks/maintenance/history.py), and marked as demo data: every
backfilled row is in the queue ``demo-backfill``, which no task is ever enqueued in, so the history
page's queue filter and its table of keys name it. An hour is backfilled only if the rollup has not
counted it and no task finished in it: real counts are never overwritten or hidden, and a second
demo start adds nothing. The hour's mark is written with it, so the rollup leaves it be (it would
otherwise recount the hour from the tasks, find none, and delete the rows).
"""

from __future__ import annotations

import datetime as dt
import math
import random

from django.db import transaction
from django.utils import timezone

from tasks.lifecycle.states import FINISHED
from tasks.maintenance.history import BOUNDS, BUCKETS
from tasks.models import ActivityHour, ActivityHourMark, Task

QUEUE = "demo-backfill"
#: (task path, share of an hour's tasks, typical run time in seconds, share failing for good)
PATHS = (
    ("tasks.demo.sleep", 0.70, 1.5, 0.0),
    ("tasks.demo.handlers.send_email", 0.15, 0.05, 0.0),
    ("tasks.demo.handlers.sync_partner", 0.10, 0.2, 0.0),
    ("tasks.demo.handlers.charge_card", 0.05, 0.1, 1.0),
)


def _bucket(seconds: float) -> int:
    return next((i for i, bound in enumerate(BOUNDS) if seconds < bound), len(BOUNDS))


def backfill_history(hours: int = 24, *, seed: int | None = None) -> int:
    """Write ``hours`` hours of demo history before the current one (those not counted and with no
    finished task); returns the hours written."""
    rng = random.Random(seed)
    now = timezone.now()
    current = now.replace(minute=0, second=0, microsecond=0)
    written = 0
    with transaction.atomic():
        for back in range(1, hours + 1):
            hour = current - dt.timedelta(hours=back)
            if ActivityHourMark.objects.filter(hour=hour).exists():
                continue
            if Task.objects.filter(
                status__in=FINISHED, finished_at__gte=hour, finished_at__lt=hour + dt.timedelta(hours=1)
            ).exists():
                continue
            # A working day's shape: busier in the afternoon, quiet at night.
            load = 0.35 + 0.65 * math.sin(math.pi * ((hour.hour - 3) % 24) / 24) ** 2
            rows = [
                _row(hour, path, int(7200 * load * share), run, failing, rng) for path, share, run, failing in PATHS
            ]
            ActivityHour.objects.bulk_create(rows)
            ActivityHourMark.objects.create(
                hour=hour,
                counted_at=now,
                keys=len(rows),
                tasks=sum(r.succeeded + r.failed + r.cancelled for r in rows),
            )
            written += 1
    return written


def _row(hour: dt.datetime, path: str, tasks: int, run: float, failing: float, rng: random.Random) -> ActivityHour:
    tasks = max(1, int(tasks * rng.uniform(0.85, 1.15)))
    failed = round(tasks * failing) if failing else rng.randint(0, max(1, tasks // 200))
    cancelled = rng.randint(0, 2) if not failing else 0
    succeeded = tasks - failed - cancelled
    timed = succeeded + failed
    wait_buckets, run_buckets = [0] * BUCKETS, [0] * BUCKETS
    wait_sum = run_sum = wait_max = run_max = 0.0
    for _ in range(timed):
        wait = rng.lognormvariate(math.log(0.05), 1.0)
        took = rng.lognormvariate(math.log(run), 0.5)
        wait_buckets[_bucket(wait)] += 1
        run_buckets[_bucket(took)] += 1
        wait_sum, run_sum = wait_sum + wait, run_sum + took
        wait_max, run_max = max(wait_max, wait), max(run_max, took)
    return ActivityHour(
        hour=hour,
        queue=QUEUE,
        task_path=path,
        succeeded=succeeded,
        failed=failed,
        cancelled=cancelled,
        attempt_failures=failed * 2 + rng.randint(0, max(1, tasks // 100)),
        timed=timed,
        wait_sum=wait_sum,
        wait_max=wait_max,
        run_sum=run_sum,
        run_max=run_max,
        wait_buckets=wait_buckets,
        run_buckets=run_buckets,
    )
