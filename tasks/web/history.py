"""The history page and ``GET /api/history``: throughput, failures and wait / run time percentiles
per hour over the last days, for all tasks or one queue and / or task path.

Every statement reads the hourly rollup (``tasks_activityhour``, written by the recovery leader:
tasks/maintenance/history.py) and its marks, never ``tasks_task``: a page costs the hours shown times
the (queue, task path) keys, whatever the tasks table holds. Percentiles come from the buckets summed
over the hours and keys asked for (tasks.maintenance.history.percentile says how).

The charts are server-rendered SVG, like the dashboard's last-hour chart: no chart library to vendor
and keep patched, no JavaScript needed to see them, and the page stays one request.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import path

from leasing.access import VIEW_TASK, staff_page
from leasing.http import api_view, iso
from leasing.routing import selected_database
from leasing.validation import InvalidInput, clean_text, parse_whole
from tasks.conf import get_settings
from tasks.maintenance.history import BUCKETS, percentile

#: Percentiles shown and served.
QUANTILES = (0.5, 0.95, 0.99)
#: Most (queue, task path) rows in the page's table and the API's ``keys``, busiest first.
SHOWN_KEYS = 50
#: Most queues and task paths offered by the page's filters.
SHOWN_OPTIONS = 200


def _bucket_sums(column: str) -> str:
    # Element-wise sums of the bucket arrays (PostgreSQL arrays are 1-based).
    return "ARRAY[" + ", ".join(f"sum({column}[{i + 1}])" for i in range(BUCKETS)) + "]::bigint[]"


_SUMS = f"""sum(succeeded), sum(failed), sum(cancelled), sum(attempt_failures), sum(timed),
       sum(wait_sum), max(wait_max), sum(run_sum), max(run_max),
       {_bucket_sums("wait_buckets")}, {_bucket_sums("run_buckets")}"""

# The rows of the window: the last ``hours`` whole hours before the current one. A range of the
# unique index tasks_activityhour_key (hour, queue, task_path); a queue or path filter is checked on
# those rows (hours x keys at most).
_WINDOW = """hour >= date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s)
      AND hour < date_trunc('hour', statement_timestamp())
      AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR task_path = %(task_path)s::text)"""

# One row per hour of the window, oldest first, zeros included: its sums over the keys asked for,
# and whether the rollup has counted it (its mark; the newest hour is counted a few minutes after
# it ends).
HOURS_SQL = f"""
WITH span AS (
    SELECT generate_series(
        date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s),
        date_trunc('hour', statement_timestamp()) - interval '1 hour',
        interval '1 hour') AS hour
), summed AS (
    SELECT hour, {_SUMS}
    FROM tasks_activityhour
    WHERE {_WINDOW}
    GROUP BY hour
)
SELECT span.hour, mark.hour IS NOT NULL, summed.*
FROM span
LEFT JOIN summed ON summed.hour = span.hour
LEFT JOIN tasks_activityhourmark AS mark ON mark.hour = span.hour
ORDER BY span.hour
"""

# The busiest keys of the window with their sums (for their own percentiles).
KEYS_SQL = f"""
SELECT queue, task_path, {_SUMS}
FROM tasks_activityhour
WHERE {_WINDOW}
GROUP BY queue, task_path
ORDER BY sum(succeeded) + sum(failed) + sum(cancelled) DESC, queue, task_path
LIMIT %(limit)s
"""

# What the filters offer: the queues and task paths seen in the window.
OPTIONS_SQL = """
SELECT DISTINCT queue, task_path
FROM tasks_activityhour
WHERE hour >= date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s)
  AND hour < date_trunc('hour', statement_timestamp())
LIMIT %(limit)s
"""


@dataclass(frozen=True)
class Times:
    """Wait or run times of a set of tasks, seconds: percentiles (None when none was timed)."""

    count: int
    mean: float | None
    largest: float | None
    percentiles: dict[float, float | None]

    @classmethod
    def of(cls, count: int, total: float, largest: float, buckets: list[int]) -> Times:
        if not count:
            return cls(0, None, None, dict.fromkeys(QUANTILES))
        return cls(
            count,
            total / count,
            largest,
            {q: percentile(buckets, q, largest=largest) for q in QUANTILES},
        )

    def json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": self.mean,
            "max": self.largest,
            **{f"p{round(q * 100)}": value for q, value in self.percentiles.items()},
        }


@dataclass(frozen=True)
class Totals:
    """Finished tasks of a set of hours and keys."""

    succeeded: int
    failed: int
    cancelled: int
    attempt_failures: int
    wait: Times
    run: Times

    @property
    def finished(self) -> int:
        return self.succeeded + self.failed + self.cancelled

    @property
    def failure_ratio(self) -> float | None:
        ended = self.succeeded + self.failed
        return self.failed / ended if ended else None

    @classmethod
    def of(cls, sums: tuple[Any, ...]) -> Totals:
        succeeded, failed, cancelled, attempt_failures, timed, wait_sum, wait_max, run_sum, run_max, wb, rb = sums
        timed = int(timed or 0)
        return cls(
            int(succeeded or 0),
            int(failed or 0),
            int(cancelled or 0),
            int(attempt_failures or 0),
            Times.of(timed, float(wait_sum or 0), float(wait_max or 0), [int(n or 0) for n in wb or [0] * BUCKETS]),
            Times.of(timed, float(run_sum or 0), float(run_max or 0), [int(n or 0) for n in rb or [0] * BUCKETS]),
        )

    def json(self) -> dict[str, Any]:
        return {
            "succeeded": self.succeeded,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "finished": self.finished,
            "attempt_failures": self.attempt_failures,
            "failure_ratio": self.failure_ratio,
            "wait_seconds": self.wait.json(),
            "run_seconds": self.run.json(),
        }


@dataclass(frozen=True)
class Hour:
    start: dt.datetime
    #: The rollup has counted it (the newest hour is counted FINAL_AFTER after it ends).
    counted: bool
    totals: Totals


@dataclass(frozen=True)
class Key:
    queue: str
    task_path: str
    totals: Totals


@dataclass(frozen=True)
class History:
    hours: int
    queue: str | None
    task_path: str | None
    series: list[Hour]
    keys: list[Key]
    totals: Totals


def history(*, hours: int, queue: str | None = None, task_path: str | None = None, using: str | None = None) -> History:
    """The last ``hours`` whole hours (oldest first) and the busiest keys, from the rollup only."""
    params = {"hours": hours, "queue": queue, "task_path": task_path, "limit": SHOWN_KEYS}
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(HOURS_SQL, params)
        series = [(Hour(row[0], bool(row[1]), Totals.of(tuple(row[3:]))), tuple(row[3:])) for row in cursor.fetchall()]
        cursor.execute(KEYS_SQL, params)
        keys = [Key(row[0], row[1], Totals.of(tuple(row[2:]))) for row in cursor.fetchall()]
    # The window's totals are the hours' sums added up here: a third pass over the rows would cost
    # as much as the hours' own.
    return History(
        hours, queue, task_path, [hour for hour, _ in series], keys, Totals.of(_added(sums for _, sums in series))
    )


def _added(rows: Iterable[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The sums of several rows of ``_SUMS``: counts and times added, maxima taken, buckets added."""
    total: list[Any] = [0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, [0] * BUCKETS, [0] * BUCKETS]
    for row in rows:
        if row[0] is None:  # an hour without rows
            continue
        for i in (0, 1, 2, 3, 4, 5, 7):
            total[i] += row[i]
        for i in (6, 8):
            total[i] = max(total[i], row[i])
        for i in (9, 10):
            total[i] = [a + b for a, b in zip(total[i], row[i], strict=True)]
    return tuple(total)


def filter_options(*, hours: int, using: str | None = None) -> tuple[list[str], list[str]]:
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(OPTIONS_SQL, {"hours": hours, "limit": SHOWN_OPTIONS})
        rows = cursor.fetchall()
    return sorted({queue for queue, _ in rows}), sorted({task_path for _, task_path in rows})


# -- input ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HistoryQuery:
    hours: int
    queue: str | None
    task_path: str | None


def parse_query(params: Any) -> HistoryQuery:
    """``?queue=&task_path=&hours=`` (hours from 1 to HISTORY_HOURS, default all of them); raises
    InvalidInput naming the bad parameter."""
    most = get_settings().HISTORY_HOURS
    unknown = sorted(set(params) - {"queue", "task_path", "hours", "db"})
    if unknown:
        raise InvalidInput(f"unknown parameter(s): {', '.join(unknown)} (known: queue, task_path, hours)", unknown[0])
    hours_text = params.get("hours", "")
    hours = most if hours_text in (None, "") else parse_whole(hours_text, "hours", low=1, high=most)
    queue = params.get("queue") or None
    task_path = params.get("task_path") or None
    return HistoryQuery(
        hours,
        None if queue is None else clean_text(queue, "queue", max_length=100),
        None if task_path is None else clean_text(task_path, "task_path", max_length=255),
    )


# -- charts --------------------------------------------------------------------------------------

WIDTH = 840
HEIGHT = 180
#: Left margin for the y axis labels, bottom margin for the x axis labels.
LEFT = 52
BOTTOM = 20
COLOURS = {
    "succeeded": "#16a34a",
    "failed": "#dc2626",
    "cancelled": "#9ca3af",
    "attempt_failures": "#f59e0b",
    "p50": "#2563eb",
    "p95": "#9333ea",
    "p99": "#db2777",
}


def duration_label(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _x_ticks(series: list[Hour], slot: float) -> list[dict[str, Any]]:
    # A label per day at midnight (UTC) over days, per 6 hours over two days or less.
    step = 24 if len(series) > 48 else 6 if len(series) > 12 else 1
    ticks = []
    for i, hour in enumerate(series):
        if hour.start.hour % step == 0:
            label = f"{hour.start:%b %d}" if step == 24 else f"{hour.start:%H:00}"
            ticks.append({"x": round(LEFT + i * slot, 1), "label": label})
    return ticks


def _series_name(name: str) -> str:
    """A rollup column as the pages name it: the Successful status's word, not the column's."""
    return "successful" if name == "succeeded" else name.replace("_", " ")


def bar_chart(series: list[Hour], names: tuple[str, ...], *, title: str, stacked: bool = True) -> dict[str, Any]:
    """Bars per hour of the ``names`` counts: stacked, or side by side (counts that overlap, such as
    tasks failed for good and failed attempts, which include theirs)."""
    values = [[_count(hour.totals, name) for name in names] for hour in series]
    peak = max([1, *(sum(row) if stacked else max(row, default=0) for row in values)])
    plot = HEIGHT - BOTTOM
    slot = (WIDTH - LEFT) / max(len(series), 1)
    bars = []
    for i, (hour, row) in enumerate(zip(series, values, strict=True)):
        base = float(plot)
        width = max(slot - 1, 0.5) / (1 if stacked else len(names))
        for j, (name, value) in enumerate(zip(names, row, strict=True)):
            if not value:
                continue
            height = value / peak * (plot - 10)
            base = base - height if stacked else plot - height
            bars.append(
                {
                    "x": round(LEFT + i * slot + 0.5 + (0 if stacked else j * width), 2),
                    "y": round(base, 2),
                    "w": round(width, 2),
                    "h": round(height, 2),
                    "fill": COLOURS[name],
                    "series": name,
                    "title": f"{hour.start:%Y-%m-%d %H:00} {_series_name(name)}: {value}",
                }
            )
    return {
        "title": title,
        "kind": "bars",
        "width": WIDTH,
        "height": HEIGHT,
        "plot": plot,
        "left": LEFT,
        "middle": ((LEFT + WIDTH) // 2, plot // 2),
        "bars": bars,
        "y_ticks": [{"y": round(plot - (plot - 10) * f, 1), "label": f"{peak * f:.4g}"} for f in (0.0, 0.5, 1.0)],
        "x_ticks": _x_ticks(series, slot),
        "legend": [{"name": _series_name(name), "colour": COLOURS[name]} for name in names],
        "empty": not bars,
    }


def _count(totals: Totals, name: str) -> int:
    value: int = getattr(totals, name)
    return value


def percentile_chart(series: list[Hour], which: str, *, title: str) -> dict[str, Any]:
    """Lines of p50 / p95 / p99 per hour on a log scale (durations span milliseconds to hours); a value
    below the scale's floor (a sub-millisecond run read as 0) is drawn on the floor."""
    values = {f"p{round(q * 100)}": [getattr(hour.totals, which).percentiles[q] for hour in series] for q in QUANTILES}
    seen = [v for line in values.values() for v in line if v is not None and v > 0]
    plot = HEIGHT - BOTTOM
    slot = (WIDTH - LEFT) / max(len(series), 1)
    low = math.floor(math.log10(min(seen))) if seen else -3
    high = math.ceil(math.log10(max(seen))) if seen else 0
    high = max(high, low + 1)

    def y_of(value: float) -> float:
        clamped = max(value, 10.0**low)
        return round(plot - (plot - 10) * (math.log10(clamped) - low) / (high - low), 2)

    lines = []
    points_total = 0
    for name, line in values.items():
        segments: list[list[str]] = [[]]
        dots = []
        for i, value in enumerate(line):
            if value is None:  # no task timed that hour (a zero is drawn on the axis's floor)
                if segments[-1]:
                    segments.append([])
                continue
            x = round(LEFT + (i + 0.5) * slot, 2)
            y = y_of(value)
            segments[-1].append(f"{x},{y}")
            dots.append({"x": x, "y": y, "title": f"{series[i].start:%Y-%m-%d %H:00} {name}: {duration_label(value)}"})
        points_total += len(dots)
        lines.append(
            {
                "name": name,
                "colour": COLOURS[name],
                "segments": [" ".join(points) for points in segments if points],
                "dots": dots,
            }
        )
    return {
        "title": title,
        "kind": "lines",
        "width": WIDTH,
        "height": HEIGHT,
        "plot": plot,
        "left": LEFT,
        "middle": ((LEFT + WIDTH) // 2, plot // 2),
        "lines": lines,
        "y_ticks": [{"y": y_of(10.0**e), "label": duration_label(10.0**e)} for e in range(low, high + 1)],
        "x_ticks": _x_ticks(series, slot),
        "legend": [{"name": line["name"], "colour": line["colour"]} for line in lines],
        "empty": points_total == 0,
    }


# -- views ---------------------------------------------------------------------------------------


@staff_page(GET=[VIEW_TASK])
def history_page(request: HttpRequest) -> HttpResponse:
    try:
        query = parse_query({k: v for k, v in request.GET.items() if k != "db"})
        error = None
    except InvalidInput as exc:
        query, error = HistoryQuery(get_settings().HISTORY_HOURS, None, None), exc.message
    found = history(hours=query.hours, queue=query.queue, task_path=query.task_path)
    queues, paths = filter_options(hours=query.hours)
    rows = [
        {
            "key": key,
            "href": "?" + urlencode({"queue": key.queue, "task_path": key.task_path, "hours": query.hours}),
            "times": _shown(key.totals),
        }
        for key in found.keys
    ]
    return render(
        request,
        "tasks/dashboard/history.html",
        {
            "query": query,
            "error": error,
            "history": found,
            "first": found.series[0].start if found.series else None,
            "uncounted": sum(1 for hour in found.series if not hour.counted),
            "charts": [
                bar_chart(found.series, ("succeeded", "failed", "cancelled"), title="Finished per hour"),
                bar_chart(
                    found.series,
                    ("failed", "attempt_failures"),
                    title="Failed for good, and failed attempts, per hour",
                    stacked=False,
                ),
                percentile_chart(found.series, "wait", title="Wait time (due to started), per hour"),
                percentile_chart(found.series, "run", title="Run time (started to finished), per hour"),
            ],
            "keys": rows,
            "totals": _shown(found.totals),
            "queues": queues,
            "paths": paths,
            "hour_choices": sorted({h for h in (6, 24, 72, 168, query.hours) if h <= get_settings().HISTORY_HOURS}),
        },
        status=400 if error else 200,
    )


def _shown(totals: Totals) -> dict[str, str]:
    """Percentiles and the failure ratio as the page prints them."""
    shown = {"failure_ratio": "-" if totals.failure_ratio is None else f"{totals.failure_ratio:.1%}"}
    for which in ("wait", "run"):
        for q, value in getattr(totals, which).percentiles.items():
            shown[f"{which}_p{round(q * 100)}"] = "-" if value is None else duration_label(value)
    return shown


def history_json(found: History) -> dict[str, Any]:
    return {
        "hours": found.hours,
        "queue": found.queue,
        "task_path": found.task_path,
        "totals": found.totals.json(),
        "series": [{"hour": iso(hour.start), "counted": hour.counted, **hour.totals.json()} for hour in found.series],
        "keys": [{"queue": key.queue, "task_path": key.task_path, **key.totals.json()} for key in found.keys],
    }


@api_view(GET=[VIEW_TASK])
def history_api(request: HttpRequest) -> tuple[int, Any]:
    query = parse_query(request.GET)
    return 200, history_json(history(hours=query.hours, queue=query.queue, task_path=query.task_path))


api_urlpatterns = [path("history", history_api, name="api-history")]
