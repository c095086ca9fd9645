"""Rate limits per key: at most ``count`` starts of a key's tasks in any sliding window of ``period``
seconds on the database clock, across every worker and process ("at most 14 calls per second to
this mail provider", "at most 100 per minute per customer").

A concurrency limit (tasks/lifecycle/concurrency.py) caps attempts in flight; a rate limit caps
*starts*. A start is the grant taken by RATE_START_SQL (tasks/lifecycle/finish.py), which the
executor sends immediately before the handler runs, in place of the ordinary start marker: in one
statement it takes a start of the key's window and marks the attempt started at the grant's clock,
or, when the window is full, hands the attempt back uncharged (READY, not an attempt, not a crash:
invariant 10) with ``run_after`` pushed to a reserved time when a start will be free.

- **Exact window.** Each key has one row in tasks_ratelimit with the grant times of the last period
  (at most ``count`` of them). A grant is given iff fewer than ``count`` of them are newer than now -
  period, with ``now`` read under the row's lock, so no window of the database clock ever holds more
  than ``count`` grants (the statement's comment proves it). No burst allowance beyond that.
- **Claimed is not started.** A worker's claims (prefetched, maybe handed back) take nothing; a
  SIGKILLed worker's grants are spent (its handlers may have run) and simply leave the window one
  period later: nothing leaks beyond the period.
- **Backlogs wait in line.** A refused attempt is sent to the key's reservation tail, which moves on
  by period / count per refusal, so a backlog of N waits at distinct times ~count per period apart, in
  the order it was first refused, and is not claimed again until its turn (a claim's range scan is
  ``run_after <= now``: deferred rows cost claims nothing). Nothing passes the line: a task never
  refused takes a free start only while nobody waits, and one that comes back before its start is
  free (the grants before it ran late) keeps its place, promised the next start the window frees
  (never the back of the line again). A backlog's task is typically refused once when the backlog is
  first claimed and, while the line runs late, once more when it comes back early.
- **Costs.** One key row read by its primary key per rate-limited start (O(count) to rewrite its
  window); tasks without a rate key, and keys not being started, cost nothing.

Configuration: per call (``Task.objects.enqueue(..., rate_key="mail", rate_limit="14/s")``), per
django.tasks task path (the backend's ``OPTIONS["rate_limits"]``), per queue
(``LEASING_TASKS["RATE_LIMITS"] = {"mail": "14/s"}``: the queue-wide key ``queue:mail``, applied by
the worker to the queue's tasks without a key of their own). Each start is checked against the
limit its task carries (as enqueued; the queue's from the worker's settings); the key's row records
the limit of its latest start. Give a key one limit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from leasing.routing import selected_database
from tasks.conf import derived, get_settings

#: Starts a window may hold at most: a start rewrites the key's window (O(count) timestamps).
MAX_RATE_COUNT = 10_000
#: The longest window, in seconds (a day).
MAX_RATE_PERIOD = 86_400.0
#: The shortest window: the database clock has microseconds, a worker's round trip milliseconds.
MIN_RATE_PERIOD = 0.001
#: The prefix of a queue-wide key (LEASING_TASKS["RATE_LIMITS"]).
QUEUE_KEY_PREFIX = "queue:"
#: Keys the dashboard and /metrics show at most.
SHOWN_KEYS = 50
#: A key's row is forgotten after this long without a start (its window is long empty by then).
IDLE_KEY_SECONDS = 3600.0

_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0, "h": 3600.0, "hour": 3600.0}
_UNITS["d"] = _UNITS["day"] = 86_400.0
_TEXT = re.compile(r"\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([a-z]+)\s*", re.IGNORECASE)


def _shown(value: Any) -> str:
    """The value in an error message, cut short (an API body may send a megabyte)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unit(name: str) -> float | None:
    name = name.lower()
    if name in _UNITS:
        return _UNITS[name]
    return _UNITS.get(name[:-1]) if len(name) > 1 and name.endswith("s") else None  # "secs", "minutes"


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` starts in any window of ``period`` seconds."""

    count: int
    period: float

    def __str__(self) -> str:
        return f"{self.count}/{self.period:g}s"


def parse_rate(value: Any) -> Rate:
    """``"14/s"``, ``"100/m"``, ``"100/min"``, ``"1000/h"``, ``"5/10s"``, ``"2/1.5s"``, a ``(count,
    seconds)`` pair or a :class:`Rate`. Raises ValueError saying what is wrong."""
    if isinstance(value, Rate):
        count, period = value.count, value.period
    elif isinstance(value, str):
        match = _TEXT.fullmatch(value)
        unit = _unit(match.group(3)) if match else None
        if match is None or unit is None:
            raise ValueError(
                f"rate limit {_shown(value)} is not of the form COUNT/UNIT or COUNT/N UNIT"
                " (e.g. '14/s', '100/min', '5/10s')"
            )
        count, period = int(match.group(1)), float(match.group(2) or 1) * unit
    elif isinstance(value, Sequence) and len(value) == 2:
        count, period = value[0], value[1]
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError(f"rate limit {_shown(value)}: the count must be a whole number")
        if isinstance(period, bool) or not isinstance(period, int | float):
            raise ValueError(f"rate limit {_shown(value)}: the period must be a number of seconds")
        period = float(period)
    else:
        raise ValueError(f"rate limit {_shown(value)} must be a string like '14/s' or a (count, seconds) pair")
    if not 1 <= count <= MAX_RATE_COUNT:
        raise ValueError(f"rate limit {_shown(value)}: the count must be from 1 to {MAX_RATE_COUNT}")
    if not (math.isfinite(period) and MIN_RATE_PERIOD <= period <= MAX_RATE_PERIOD):
        raise ValueError(
            f"rate limit {_shown(value)}: the period must be from {MIN_RATE_PERIOD} to {MAX_RATE_PERIOD:g}s"
        )
    return Rate(int(count), period)


def validate_rate_key(key: Any) -> str:
    if not isinstance(key, str) or not key or len(key) > 255:
        raise ValueError("rate_key must be a non-empty string of at most 255 characters")
    if "\x00" in key:
        raise ValueError("rate_key must not contain NUL characters")
    try:
        key.encode()
    except UnicodeEncodeError:
        raise ValueError("rate_key must be valid Unicode (no lone surrogates)") from None
    return key


def rate_for_enqueue(key: Any, limit: Any) -> tuple[str, Rate] | None:
    """A rate key comes with a limit, and a limit with a key (None: neither)."""
    if key is None and limit is None:
        return None
    if key is None or limit is None:
        raise ValueError("rate_key and rate_limit go together: give both or neither")
    return validate_rate_key(key), parse_rate(limit)


def queue_rates() -> dict[str, Rate]:
    """LEASING_TASKS["RATE_LIMITS"], parsed (queue name -> its rate); ValueError when malformed."""
    return derived("rate_limits", lambda: parse_queue_rates(get_settings().RATE_LIMITS))


def parse_queue_rates(raw: Any) -> dict[str, Rate]:
    if not isinstance(raw, dict):
        raise ValueError("LEASING_TASKS['RATE_LIMITS'] must map queue names to rate limits such as '14/s'")
    rates: dict[str, Rate] = {}
    for queue, value in raw.items():
        if not isinstance(queue, str) or not queue or len(queue) > 100:
            raise ValueError(f"LEASING_TASKS['RATE_LIMITS']: {queue!r} is not a queue name")
        try:
            rates[queue] = parse_rate(value)
        except ValueError as exc:
            raise ValueError(f"LEASING_TASKS['RATE_LIMITS'][{queue!r}]: {exc}") from None
    return rates


def queue_rate(queue: str) -> tuple[str, Rate] | None:
    """The queue-wide key and rate of ``queue`` (for its tasks without a rate key of their own)."""
    rate = queue_rates().get(queue)
    return None if rate is None else (QUEUE_KEY_PREFIX + queue, rate)


# The keys at their limit (or near it): those whose window holds a grant within the last period, read
# from the rows alone (a row per key with recent starts; tasks_task is not read). Each key's window
# is counted in SQL on the database clock. Bounded by ``limit`` rows of the idle index's newest end.
KEY_STATS_SQL = """
SELECT k.key, k.max_starts, k.period,
       (SELECT count(*) FROM unnest(k.starts) AS s(at)
        WHERE s.at > clock_timestamp() - make_interval(secs => k.period))::int AS in_window,
       k.grants, k.refusals, k.retry_at, k.decided_at
FROM (SELECT * FROM tasks_ratelimit ORDER BY decided_at DESC LIMIT %(limit)s) AS k
"""

# Key rows without a start for IDLE_KEY_SECONDS: their window is empty, so deleting them forgets
# nothing but the totals; a later start inserts the row again. Locked rows are left for the next round.
PRUNE_IDLE_KEYS_SQL = """
DELETE FROM tasks_ratelimit AS k
WHERE k.key = ANY(ARRAY(  -- run once (tasks/lifecycle/claim.py, PICK_ONE, says why)
    SELECT i.key FROM tasks_ratelimit AS i
    -- The bound the index can take (idle, on the statement's clock: a volatile clock_timestamp() is
    -- no index bound), then each row's own (a whole period): a bound that depends on the row, or on
    -- a volatile clock, is a filter, and read every live key of the index.
    WHERE i.decided_at < statement_timestamp() - make_interval(secs => %(idle)s)
      AND i.decided_at < clock_timestamp() - make_interval(secs => i.period)
    ORDER BY i.decided_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))
RETURNING k.key
"""


@dataclass(frozen=True, slots=True)
class RateKeyState:
    """One rate key as the database has it now."""

    key: str
    count: int
    period: float
    #: Grants in the window ending now.
    in_window: int
    grants: int
    refusals: int
    #: Where the last refused start was sent (None: never refused).
    retry_at: Any = None
    decided_at: Any = None

    @property
    def full(self) -> bool:
        return self.in_window >= self.count

    @property
    def rate(self) -> Rate:
        return Rate(self.count, self.period)


def rate_key_states(*, using: str | None = None, limit: int = SHOWN_KEYS) -> list[RateKeyState]:
    """The ``limit`` keys started most recently, fullest first."""
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(KEY_STATS_SQL, {"limit": limit})
        rows: list[Any] = cursor.fetchall()
    states = [RateKeyState(*row) for row in rows]
    states.sort(key=lambda s: (not s.full, -s.in_window / s.count, s.key))
    return states


def prune_idle_keys(*, using: str = DEFAULT_DB_ALIAS, idle: float = IDLE_KEY_SECONDS, limit: int = 1000) -> int:
    """Forget the rows of keys without a start for ``idle`` seconds (and a whole period)."""
    with connections[using].cursor() as cursor:
        cursor.execute(PRUNE_IDLE_KEYS_SQL, {"idle": idle, "limit": limit})
        return cursor.rowcount
