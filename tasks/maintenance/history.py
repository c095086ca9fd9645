"""History: finished tasks rolled up by hour, queue and task path, for the history page and
``/api/history`` (7 days by default: ``LEASING_TASKS["HISTORY_HOURS"]``).

- **Where the numbers come from.** The per-minute activity rows (tasks/lifecycle/activity.py) count
  the whole queue: they hold no queue, no task path and no durations, so they cannot be split by key
  or give a percentile. An hour is therefore counted from the rows themselves, once: one statement
  reads the hour's range of each final status in the finish-time index (``tasks_task_prune_idx``,
  the same ranges the minute rollup reads for its sixty minutes) and writes one row per (queue, task path) that finished
  in it. Pages read only these rows: 168 hours times the keys, whatever tasks_task holds.
- **Counted once it is over.** An hour is counted ``FINAL_AFTER`` (5 minutes, the minute rollup's
  final count) after it ends, when finishes committed late have landed; the open hour is left to the
  dashboard's last-hour chart. A mark per hour (``ActivityHourMark``, zero tasks included) says it is
  counted; a round counts the unmarked hours of the kept window, newest first, within its time budget.
- **Idempotent.** The statement recomputes the hour from the tasks and *overwrites* its rows
  (``ON CONFLICT … DO UPDATE SET x = EXCLUDED.x``), and writes the mark in the same statement, so a
  round that crashes commits nothing and its rerun counts the hour whole; two leaders counting the
  same hour at once (a deposed one that has not noticed yet, or ``recover_tasks --once`` beside the
  worker's) write the same numbers twice, never the sum. Rows are inserted in key order, so two such
  statements take the unique index's locks in the same order and cannot deadlock.
- **Percentiles from histograms.** A percentile cannot be rolled up: the p95 of a day is not any
  mean of its hours' p95s. Each row keeps the count of tasks per fixed bucket of wait and run time
  (``BOUNDS``: a 1-2-5 series from 1 ms to 10,000 s), which add up across hours and keys; a percentile
  is read from the summed buckets by linear interpolation inside the bucket it falls in (as
  Prometheus's ``histogram_quantile``), capped by the largest value seen. Its error is bounded by that
  bucket's width (at most 2.5x between its bounds), and the count behind it is exact.
- **What the times are.** Wait: from when the task's last attempt was due (``run_after``, which a
  retry, a snooze or a workflow's release moves) to that attempt's start (``last_attempted_at``);
  run: from that start to ``finished_at``. Only tasks that ended SUCCESSFUL or FAILED with an attempt
  started are timed; cancelled ones are counted, not timed.
- **Retention.** Hours older than ``HISTORY_HOURS`` are deleted by the same round. Finished tasks
  must be kept until their hour is counted (retention of minutes would lose them from the history):
  the defaults keep them for days.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS, connections

from leasing.bounds import without_jit
from tasks.conf import get_settings

logger = logging.getLogger("tasks.history")

#: Upper bounds (seconds, exclusive) of the wait and run time buckets; one more bucket holds what is
#: at or above the last. A 1-2-5 series: a percentile read from it is within one bucket's width.
BOUNDS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
    10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
)  # fmt: skip
BUCKETS = len(BOUNDS) + 1
#: Seconds after its end when an hour is counted (late commits have landed: activity.FINAL_AFTER).
FINAL_AFTER = 300
#: Seconds after which an hour's count stands: a count of it begun later changes nothing (the mover,
#: tasks/maintenance/archive.py, moves an hour's tasks out of tasks_task only then).
COUNTED_MARGIN = 300

_BOUNDS_SQL = "ARRAY[" + ", ".join(repr(bound) for bound in BOUNDS) + "]::float8[]"


def _histogram(column: str) -> str:
    # One count per bucket in the same pass as the other aggregates: width_bucket() gives 0 below
    # the first bound, i for [BOUNDS[i-1], BOUNDS[i]), len(BOUNDS) at or above the last.
    return "ARRAY[" + ", ".join(f"count(*) FILTER (WHERE {column} = {i})" for i in range(BUCKETS)) + "]::bigint[]"


# Count one hour and store it: every (queue, task path) that finished in it, overwritten whole, and
# the hour's mark, in one statement (one transaction: all or nothing). The finished CTE is the range
# [hour, hour + 1 h) of each final status in tasks_task_prune_idx (status, finished_at, id); the times
# use the database's own timestamps.
COUNT_HOUR_SQL = f"""
WITH settled AS MATERIALIZED (
    -- An hour counted COUNTED_MARGIN ago or more stands: a count begun since (a deposed leader's, a
    -- cron run's, from a list of due hours read before the mark) changes nothing. Its tasks may have
    -- left tasks_task meanwhile (the mover, tasks/maintenance/archive.py, waits that long).
    SELECT 1 FROM tasks_activityhourmark
    WHERE hour = %(hour)s::timestamptz AND counted_at < statement_timestamp() - make_interval(secs => %(margin)s)
), finished AS MATERIALIZED (
    SELECT queue, task_path, status, failures, timed.wait, timed.run,
           width_bucket(timed.wait, {_BOUNDS_SQL}) AS wait_bucket,
           width_bucket(timed.run, {_BOUNDS_SQL}) AS run_bucket
    FROM tasks_task
    CROSS JOIN LATERAL (
        -- Timed: a task whose last attempt ran. ``attempts`` > 0 as well as ``last_attempted_at``: a
        -- retry (bulk or an operator's) starts the count again but keeps the old attempt's time, and a
        -- task discarded before it ran again was timed with it (a 48-hour "run").
        SELECT CASE WHEN status IN ('SUCCESSFUL', 'FAILED') AND last_attempted_at IS NOT NULL AND attempts > 0
                    THEN GREATEST(EXTRACT(EPOCH FROM last_attempted_at - run_after)::float8, 0) END AS wait,
               CASE WHEN status IN ('SUCCESSFUL', 'FAILED') AND last_attempted_at IS NOT NULL AND attempts > 0
                    THEN GREATEST(EXTRACT(EPOCH FROM finished_at - last_attempted_at)::float8, 0) END AS run
    ) AS timed
    WHERE status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
      AND finished_at >= %(hour)s::timestamptz AND finished_at < %(hour)s::timestamptz + interval '1 hour'
      AND NOT EXISTS (SELECT 1 FROM settled)
), keyed AS (
    SELECT queue, task_path,
           count(*) FILTER (WHERE status = 'SUCCESSFUL') AS succeeded,
           count(*) FILTER (WHERE status = 'FAILED') AS failed,
           count(*) FILTER (WHERE status = 'CANCELLED') AS cancelled,
           COALESCE(sum(failures), 0) AS attempt_failures,
           count(wait) AS timed,
           COALESCE(sum(wait), 0) AS wait_sum, COALESCE(max(wait), 0) AS wait_max,
           COALESCE(sum(run), 0) AS run_sum, COALESCE(max(run), 0) AS run_max,
           {_histogram("wait_bucket")} AS wait_buckets,
           {_histogram("run_bucket")} AS run_buckets,
           count(*) AS tasks
    FROM finished
    GROUP BY queue, task_path
), stored AS (
    INSERT INTO tasks_activityhour AS h
        (hour, queue, task_path, succeeded, failed, cancelled, attempt_failures, timed,
         wait_sum, wait_max, run_sum, run_max, wait_buckets, run_buckets)
    SELECT %(hour)s::timestamptz, queue, task_path, succeeded, failed, cancelled, attempt_failures, timed,
           wait_sum, wait_max, run_sum, run_max, wait_buckets, run_buckets
    FROM keyed
    ORDER BY queue, task_path
    ON CONFLICT (hour, queue, task_path) DO UPDATE SET
        succeeded = EXCLUDED.succeeded, failed = EXCLUDED.failed, cancelled = EXCLUDED.cancelled,
        attempt_failures = EXCLUDED.attempt_failures, timed = EXCLUDED.timed,
        wait_sum = EXCLUDED.wait_sum, wait_max = EXCLUDED.wait_max,
        run_sum = EXCLUDED.run_sum, run_max = EXCLUDED.run_max,
        wait_buckets = EXCLUDED.wait_buckets, run_buckets = EXCLUDED.run_buckets
    RETURNING 1
), gone AS (
    -- Overwritten whole: the keys of an earlier count with no task in the hour now (retried out of
    -- it, pruned) go (their first counts stayed). Disjoint from ``stored``'s rows.
    DELETE FROM tasks_activityhour AS g
    WHERE g.hour = %(hour)s::timestamptz
      AND NOT EXISTS (SELECT 1 FROM keyed AS k WHERE k.queue = g.queue AND k.task_path = g.task_path)
      AND NOT EXISTS (SELECT 1 FROM settled)
    RETURNING 1
)
INSERT INTO tasks_activityhourmark AS m (hour, counted_at, keys, tasks)
SELECT %(hour)s::timestamptz, clock_timestamp(), (SELECT count(*) FROM stored) + 0 * (SELECT count(*) FROM gone),
       (SELECT COALESCE(sum(tasks), 0) FROM keyed)
WHERE NOT EXISTS (SELECT 1 FROM settled)
ON CONFLICT (hour) DO UPDATE SET counted_at = EXCLUDED.counted_at, keys = EXCLUDED.keys, tasks = EXCLUDED.tasks
RETURNING m.tasks
"""

# The hours of the kept window that are over (by FINAL_AFTER) and not counted yet, newest first: the
# recent past shows first after a long pause. At most HISTORY_HOURS rows of generate_series, each a
# primary-key probe of the marks.
DUE_HOURS_SQL = """
SELECT h.hour
FROM generate_series(
    date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s),
    date_trunc('hour', statement_timestamp() - make_interval(secs => %(final_after)s)) - interval '1 hour',
    interval '1 hour') AS h(hour)
WHERE NOT EXISTS (SELECT 1 FROM tasks_activityhourmark AS m WHERE m.hour = h.hour)
ORDER BY h.hour DESC
"""

# The due hours that end before the earliest finish in tasks_task (a fresh install's window, a long
# quiet spell) marked counted with nothing in them, all in one statement: each of them would be one
# COUNT_HOUR_SQL finding no task, 168 on a first start (its planning alone cost 3 ms each). An hour
# with keys stored is left to COUNT_HOUR_SQL, which deletes them. A finish is stamped with the
# database's clock and lands in an hour not yet due; the hours at or after the earliest finish are
# counted one by one as before. The earliest finish is the least of each final status's first entry
# in tasks_task_prune_idx (an index of finished_at alone would cost every finish an entry more).
MARK_EMPTY_HOURS_SQL = """
INSERT INTO tasks_activityhourmark AS m (hour, counted_at, keys, tasks)
SELECT h.hour, clock_timestamp(), 0, 0
FROM unnest(%(hours)s::timestamptz[]) AS h(hour)
WHERE h.hour + interval '1 hour' <= COALESCE(
        LEAST((SELECT min(finished_at) FROM tasks_task WHERE status = 'SUCCESSFUL' AND finished_at IS NOT NULL),
              (SELECT min(finished_at) FROM tasks_task WHERE status = 'FAILED' AND finished_at IS NOT NULL),
              (SELECT min(finished_at) FROM tasks_task WHERE status = 'CANCELLED' AND finished_at IS NOT NULL)),
        'infinity'::timestamptz)
  AND NOT EXISTS (SELECT 1 FROM tasks_activityhour AS a WHERE a.hour = h.hour)
ON CONFLICT (hour) DO NOTHING
RETURNING m.hour
"""

# Hours past the kept window (the unique index's leading column; the marks' primary key).
PRUNE_HOURS_SQL = """
DELETE FROM tasks_activityhour
WHERE hour < date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s)
"""
# The hours' marks (which hours are rolled up) past the kept window, by their primary key.
PRUNE_MARKS_SQL = """
DELETE FROM tasks_activityhourmark
WHERE hour < date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s)
"""


def count_hour(hour: dt.datetime, *, using: str = DEFAULT_DB_ALIAS) -> int:
    """Count one hour (its start) from the tasks and store it, overwriting what was there; returns
    the tasks it found (0: none, or the hour was counted COUNTED_MARGIN ago and stands)."""
    with without_jit(), connections[using].cursor() as cursor:
        cursor.execute(COUNT_HOUR_SQL, {"hour": hour, "margin": COUNTED_MARGIN})
        row = cursor.fetchone()
    return 0 if row is None else int(row[0])


def due_hours(*, using: str = DEFAULT_DB_ALIAS, hours: int | None = None) -> list[dt.datetime]:
    params = {"hours": hours or get_settings().HISTORY_HOURS, "final_after": FINAL_AFTER}
    with connections[using].cursor() as cursor:
        cursor.execute(DUE_HOURS_SQL, params)
        return [row[0] for row in cursor.fetchall()]


def mark_empty_hours(hours: Sequence[dt.datetime], *, using: str = DEFAULT_DB_ALIAS) -> set[dt.datetime]:
    """Mark counted, with no task, those of ``hours`` that end before any task in tasks_task
    finished and have no keys stored; returns the hours it marked."""
    if not hours:
        return set()
    with connections[using].cursor() as cursor:
        cursor.execute(MARK_EMPTY_HOURS_SQL, {"hours": list(hours)})
        return {row[0] for row in cursor.fetchall()}


def prune_history(*, using: str = DEFAULT_DB_ALIAS, hours: int | None = None) -> int:
    """Delete the hours older than the kept window; returns the rows deleted."""
    params = {"hours": hours or get_settings().HISTORY_HOURS}
    with connections[using].cursor() as cursor:
        cursor.execute(PRUNE_HOURS_SQL, params)
        deleted = cursor.rowcount
        cursor.execute(PRUNE_MARKS_SQL, params)
    return deleted


@dataclass(frozen=True)
class RollupRound:
    """What one round did: the hours counted (their starts), the tasks found, the rows pruned."""

    counted: tuple[dt.datetime, ...]
    tasks: int
    pruned: int
    #: Hours still due when the round's budget ran out.
    left: int


def roll_up_hours(
    *,
    using: str = DEFAULT_DB_ALIAS,
    budget: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RollupRound:
    """Count the due hours, newest first, for up to ``budget`` seconds (at least one hour; None:
    every due hour), then delete the hours past the window. The hours before the earliest finish
    are marked empty first, in one statement, and are among those counted."""
    due = due_hours(using=using)
    empty = mark_empty_hours(due, using=using)
    deadline = None if budget is None else clock() + budget
    counted: list[dt.datetime] = []
    tasks = 0
    for hour in (hour for hour in due if hour not in empty):
        if counted and deadline is not None and clock() >= deadline:
            break
        tasks += count_hour(hour, using=using)
        counted.append(hour)
    counted += [hour for hour in due if hour in empty]  # the oldest: before the earliest finish
    pruned = prune_history(using=using)
    if tasks:
        logger.info("history: counted %d hour(s), %d finished task(s)", len(counted), tasks)
    return RollupRound(tuple(counted), tasks, pruned, len(due) - len(counted))


@dataclass
class HistoryRollup:
    """The recovery leader's history round: every ``interval`` seconds at most, count what is due
    within a slice of time (tasks/maintenance/recovery.py calls it between recovery rounds)."""

    using: str = DEFAULT_DB_ALIAS
    interval: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _next_at: float = 0.0
    rounds: list[RollupRound] = field(default_factory=list)

    def run_for(self, budget: float) -> RollupRound | None:
        now = self.clock()
        if now < self._next_at:
            return None
        done = roll_up_hours(using=self.using, budget=budget, clock=self.clock)
        # Still behind (a long pause, a first start on a full table): come back next round.
        self._next_at = now if done.left else now + self.interval
        self.rounds = [*self.rounds[-9:], done]
        return done


# -- reading -------------------------------------------------------------------------------------


def percentile(buckets: Sequence[int], q: float, *, largest: float) -> float | None:
    """The ``q``-quantile (0 < q <= 1) of the values counted in ``buckets`` (BOUNDS), interpolated
    linearly inside the bucket where it falls and capped by ``largest`` (the largest value seen);
    None when nothing was counted."""
    if not 0 < q <= 1:
        raise ValueError(f"a quantile is in (0, 1], got {q!r}")
    if len(buckets) != BUCKETS:
        raise ValueError(f"expected {BUCKETS} buckets, got {len(buckets)}")
    total = sum(buckets)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(buckets):
        if count and seen + count >= rank:
            lower = BOUNDS[index - 1] if index else 0.0
            upper = BOUNDS[index] if index < len(BOUNDS) else largest
            upper = min(upper, largest) if math.isfinite(largest) and largest >= lower else upper
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
    return largest  # unreachable: rank <= total
