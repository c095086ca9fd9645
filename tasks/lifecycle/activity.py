"""Per-minute queue activity (tasks succeeded, failed for good, recovered) for the dashboard chart and
``/metrics``, kept as a rollup so that no page scans the tasks finished in the last hour.

- **Closed minutes are counted once.** A minute that ended more than ``LAG`` seconds ago is counted
  from the finish-time index (``tasks_task_prune_idx``: one minute of each of the two statuses, one
  statement) and stored in ``ActivityMinute``; a page load then counts only the open part of the
  hour: the current minute and the ``LAG`` seconds before it. ``roll_up()`` does the counting; the
  recovery controller calls it every round, and pages call it too, so a minute is counted by
  whichever comes first (idempotent: the same counts overwrite the same row). The first call after
  a long pause counts every closed minute of the last hour once.
- **Late commits.** ``finished_at`` is the clock read inside the finishing statement; the row becomes
  visible when its transaction commits. A finish committed more than ``LAG`` seconds after it was
  stamped would be missed by the first count, so every minute is counted a second (final) time once
  it is ``FINAL_AFTER`` old. A finish committed later still is not in the chart.
- **Recoveries are recorded by the recovery statement itself** (``RECOVER_EXPIRED_SQL`` in
  tasks/lifecycle/recover.py, one statement: the requeue and its record commit together), so the
  recovered series and the death-to-requeue figures are exact and read from at most 60 rows.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django.db import connections

from leasing.routing import selected_database

#: Seconds a minute stays open after it ends (finishes still committing land in its first count).
LAG = 5
#: Seconds after its end when a minute is counted for the last time.
FINAL_AFTER = 300
MINUTES = 60
#: Rows older than this are deleted when a minute is closed.
KEEP = "1 day"


# The closed minutes of the last hour still to count: never counted, or counted but not final
# while they are old enough to be. Times come from the database clock.
_DUE_SQL = """
SELECT m.minute, m.minute + interval '1 minute' <= statement_timestamp() - make_interval(secs => %(final_after)s)
FROM generate_series(
    date_trunc('minute', statement_timestamp()) - make_interval(mins => %(minutes)s - 1),
    date_trunc('minute', statement_timestamp() - make_interval(secs => %(lag)s)) - interval '1 minute',
    interval '1 minute') AS m(minute)
LEFT JOIN tasks_activityminute AS a ON a.minute = m.minute
WHERE a.minute IS NULL OR NOT a.closed
   OR (NOT a.final AND m.minute + interval '1 minute' <= statement_timestamp() - make_interval(secs => %(final_after)s))
ORDER BY m.minute
"""

# Count one minute from the finish-time index (tasks_task_prune_idx: one range per status counted)
# and store it, zeros included (a stored row is what marks the minute closed). A final row is never
# overwritten: a late provisional count racing with it must not undo it.
_COUNT_SQL = """
INSERT INTO tasks_activityminute AS a
    (minute, succeeded, failed, closed, final, recovered, silent_total, silent_max, delay_max)
SELECT %(minute)s::timestamptz, count(*) FILTER (WHERE status = 'SUCCESSFUL'),
       count(*) FILTER (WHERE status = 'FAILED'), true, %(final)s, 0, 0, 0, 0
FROM tasks_task
WHERE status IN ('SUCCESSFUL', 'FAILED')
  AND finished_at >= %(minute)s::timestamptz AND finished_at < %(minute)s::timestamptz + interval '1 minute'
ON CONFLICT (minute) DO UPDATE SET
    succeeded = EXCLUDED.succeeded, failed = EXCLUDED.failed, closed = true, final = EXCLUDED.final
WHERE NOT a.final
"""

_PRUNE_SQL = f"DELETE FROM tasks_activityminute WHERE minute < statement_timestamp() - interval '{KEEP}'"

_HOUR_SQL = """
SELECT statement_timestamp(), minute, succeeded, failed, recovered, closed
FROM tasks_activityminute
WHERE minute >= date_trunc('minute', statement_timestamp()) - make_interval(mins => %(minutes)s - 1)
"""

# The open part of the hour, counted live: from the first minute not yet closed, up to now.
_LIVE_SQL = """
SELECT date_trunc('minute', finished_at), count(*) FILTER (WHERE status = 'SUCCESSFUL'),
       count(*) FILTER (WHERE status = 'FAILED')
FROM tasks_task
WHERE status IN ('SUCCESSFUL', 'FAILED') AND finished_at >= %(since)s AND finished_at <= statement_timestamp()
GROUP BY 1
"""

_RECOVERIES_SQL = """
SELECT COALESCE(sum(recovered), 0), COALESCE(max(silent_max), 0), sum(silent_total) / NULLIF(sum(recovered), 0),
       COALESCE(max(delay_max), 0)
FROM tasks_activityminute
WHERE minute >= date_trunc('minute', statement_timestamp()) - make_interval(mins => %(minutes)s - 1)
"""


def roll_up(*, using: str | None = None) -> int:
    """Count the closed minutes of the last hour that are due; returns how many minutes were stored."""
    params = {"minutes": MINUTES, "lag": LAG, "final_after": FINAL_AFTER}
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(_DUE_SQL, params)
        due: list[tuple[dt.datetime, bool]] = cursor.fetchall()
        if not due:
            return 0
        # One statement per minute: each an index range of one minute of finishes (a catch-up over
        # the whole hour would otherwise be one range big enough for a sequential scan).
        for minute, final in due:
            cursor.execute(_COUNT_SQL, {"minute": minute, "final": final})
        cursor.execute(_PRUNE_SQL)
    return len(due)


def last_hour(*, using: str | None = None) -> dict[str, list[int]]:
    """Per minute over the last hour (oldest first, the current minute last): tasks succeeded, failed
    for good and recovered. Closed minutes come from the rollup; only the open ones are counted."""
    roll_up(using=using)
    series = {name: [0] * MINUTES for name in ("succeeded", "failed", "recovered")}
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(_HOUR_SQL, {"minutes": MINUTES})
        rows = cursor.fetchall()
        if not rows:
            cursor.execute("SELECT statement_timestamp()")
            now = cursor.fetchone()[0]
        else:
            now = rows[0][0]
        first = now.replace(second=0, microsecond=0) - dt.timedelta(minutes=MINUTES - 1)
        closed = set()
        for _, minute, succeeded, failed, recovered, is_closed in rows:
            index = _index(minute, first)
            if index is None:
                continue
            series["recovered"][index] += recovered
            if is_closed:
                closed.add(index)
                series["succeeded"][index] += succeeded
                series["failed"][index] += failed
        # roll_up() has just closed every closed minute, so this is the current minute or the one
        # before it (within LAG); if a minute was left open, the live count starts there.
        open_from = min((i for i in range(MINUTES) if i not in closed), default=MINUTES)
        if open_from < MINUTES:
            cursor.execute(_LIVE_SQL, {"since": first + dt.timedelta(minutes=open_from)})
            for minute, succeeded, failed in cursor.fetchall():
                index = _index(minute, first)
                if index is not None and index not in closed:
                    series["succeeded"][index] += succeeded
                    series["failed"][index] += failed
    return series


def _index(minute: dt.datetime, first: dt.datetime) -> int | None:
    index = int((minute - first).total_seconds() // 60)
    return index if 0 <= index < MINUTES else None


@dataclass(frozen=True)
class Recoveries:
    """Recoveries over the last hour, from the rollup."""

    count: int
    silent_max: float
    silent_avg: float
    delay_max: float


def recoveries_last_hour(*, using: str | None = None) -> Recoveries:
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(_RECOVERIES_SQL, {"minutes": MINUTES})
        row: Any = cursor.fetchone()
    count, silent_max, silent_avg, delay_max = row
    return Recoveries(int(count), float(silent_max), float(silent_avg or 0.0), float(delay_max))
