"""Rate limits per key: at most ``count`` starts of a key's tasks in any sliding window of ``period``
seconds on the database clock, across every worker and process ("at most 14 calls per second to
this mail provider", "at most 100 per minute per customer").

A concurrency limit (tasks/lifecycle/concurrency.py) caps attempts in flight; a rate limit caps
*starts*. A start is the grant taken by RATE_START_SQL (below), which the
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
from tasks.lifecycle.fragments import HELD, WAITING_STATUS

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


# A rate-limited attempt's start: ONE statement takes a start of its
# rate key's sliding window and marks the attempt started at the grant's clock, or, when the key cannot
# give it a start now, hands the attempt back uncharged (invariant 10: no attempt, no crash, no unstarted
# return) with run_after pushed to when its start is due. Sent by the executor right before the handler
# runs (as START_SQL for a suspect), so a start is counted when a handler really begins, not when a
# worker prefetches a claim; a claim that never started never took one.
#
# - ``mine`` locks the task row first (held by this worker, this token, a live lease): a lapsed claim
#   takes nothing; one already started (the reply to the first copy was lost) takes nothing again.
#   The lock order is always task row, then key row. A task without a rate key of its own takes its
#   queue's (``key``, ``limit``, ``period``: LEASING_TASKS["RATE_LIMITS"] as the worker has it).
# - ``slot`` is an upsert on the key's primary key (one row, one index probe; the first start of a
#   key inserts it). The SET is one sub-SELECT so that one clock reading, taken under the key row's
#   lock, decides and is recorded: grants of a key are serialised by that lock, so their times only
#   grow, and a grant needs fewer than ``max_starts`` recorded grants newer than now - period. Then
#   every window [w, w + period) holds at most max_starts grants: the last of them to be granted
#   counted all the others. ``starts`` keeps only the grants inside the window (at most max_starts,
#   oldest first), so the row stays small and the cost is O(max_starts), whatever the number of keys
#   or tasks. Strict by construction: no burst allowance (a token bucket with a burst of N lets 2N
#   starts into one window).
# - The key's refused tasks wait in line, in the order they were first refused, and nothing passes
#   them (issue 38: a backlog's first hundred tasks started in the last seconds of its drain).
#   * A task never refused (``rate_refusals`` 0) takes a free start only while nobody waits
#     (``line_open``): else it joins the back of the line, ``next_due``, the key's reservation tail,
#     which moves on by period / max_starts per refusal, so a backlog waits at distinct times at the
#     key's rate instead of coming due all at once (a claim's range scan is ``run_after <= now``:
#     deferred rows cost claims nothing).
#   * A task back from the line takes a free start. If none is free yet (its reservation came early:
#     the grants before it ran late), it keeps its place: it is given the next start the window frees
#     after the last one promised to a task back from the line (``promised_until``), exact while the
#     window holds the grant that frees it, else a step after the last promise. Sending such a task to
#     the back of the line again (once a quick retry missed) reshuffled the line: 4.97 refusals per
#     start, and a backlog's first tasks started last.
# - The tail is ``next_due``, but not far past the latest live reservation of a task with this key of its
#   own (tasks_task_rate_line_idx, read backwards from the end: one entry while the line is live): a
#   backlog cancelled or deleted, or a limit raised, leaves ``next_due`` far ahead with nobody in line,
#   and new refusals would queue after reservations nobody holds while the window stands empty (a
#   cancelled backlog: 58 s instead of 2). That read is the statement's snapshot, taken before it waited for the key
#   row: the refusals committed meanwhile (one per start in flight, under a window's worth) are not in
#   it, so the bound leaves them a period; a bound of one step gave several refusals of a burst the
#   same reservation, and their tasks came back together to one free start. Queue-wide keys (no rate
#   key on the row) keep ``next_due``.
# - A keyed task (concurrency) refused waits BLOCKED, giving its concurrency slot up while it waits.
_RATE_WINDOW = "make_interval(secs => excluded.period)"
_RATE_STEP = "make_interval(secs => excluded.period / excluded.max_starts)"
_RATE_TAIL = f"""CASE WHEN (SELECT m.queue_wide FROM mine AS m) THEN k.next_due ELSE LEAST(k.next_due, COALESCE(
                   (SELECT r.run_after FROM tasks_task AS r
                    WHERE r.rate_key = excluded.key AND r.status IN ('READY', 'BLOCKED') AND r.run_after > c.now
                    ORDER BY r.run_after DESC LIMIT 1) + {_RATE_WINDOW} + {_RATE_STEP},
                   '-infinity')) END"""
# The grant: a rate-limited attempt's start, taken under its key's row lock if the key has a start
# left in its period, else refused with when to come back (the row waits in line: READY, or BLOCKED
# for a keyed task, giving its slot up). Strict: at most max_starts grants in any window of a period;
# the line's rules above (tasks/lifecycle/ratelimits.py has the user's side).
RATE_START_SQL = f"""
WITH mine AS MATERIALIZED (
    SELECT t.id, COALESCE(t.rate_key, %(key)s::text) AS rate_key,
           CASE WHEN t.rate_key IS NULL THEN %(limit)s::int ELSE t.rate_limit END AS rate_limit,
           CASE WHEN t.rate_key IS NULL THEN %(period)s::float8 ELSE t.rate_period END AS rate_period,
           t.rate_refusals > 0 AS in_line, t.attempt_started, t.rate_key IS NULL AS queue_wide
    FROM tasks_task AS t
    WHERE t.id = %(id)s::bigint AND t.token = %(token)s::bigint AND {HELD} AND t.expires_at > clock_timestamp()
      AND COALESCE(t.rate_key, %(key)s::text) IS NOT NULL
    FOR NO KEY UPDATE OF t
), slot AS (
    INSERT INTO tasks_ratelimit AS k (key, max_starts, period, starts, next_due, grants, refusals, retry_at,
                                      promised_until, decided_at, granted)
    SELECT m.rate_key, m.rate_limit, m.rate_period, ARRAY[c.now], c.now, 1, 0, NULL, NULL, c.now, true
    FROM mine AS m, (SELECT clock_timestamp() AS now) AS c WHERE NOT m.attempt_started
    ON CONFLICT (key) DO UPDATE SET (max_starts, period, starts, next_due, grants, refusals, retry_at,
                                     promised_until, decided_at, granted) = (
        SELECT excluded.max_starts, excluded.period,
               CASE WHEN d.granted THEN w.kept || c.now ELSE w.kept END,
               CASE WHEN d.granted OR l.in_line THEN k.next_due ELSE d.sent_to + {_RATE_STEP} END,
               k.grants + d.granted::int,
               k.refusals + (NOT d.granted)::int,
               CASE WHEN d.granted THEN k.retry_at ELSE d.sent_to END,
               CASE WHEN NOT d.granted AND l.in_line THEN d.sent_to ELSE k.promised_until END,
               c.now,
               d.granted
        FROM (SELECT clock_timestamp() AS now) AS c
        CROSS JOIN LATERAL (
            SELECT COALESCE(array_agg(s.at ORDER BY s.at), '{{}}') AS kept, count(*)::int AS n
            FROM unnest(k.starts) AS s(at) WHERE s.at > c.now - {_RATE_WINDOW}
        ) AS w
        CROSS JOIN LATERAL (
            SELECT w.n >= excluded.max_starts AS full,
                   w.kept[w.n - excluded.max_starts + 1] + {_RATE_WINDOW} AS frees,
                   (SELECT m.in_line FROM mine AS m) AS in_line,
                   {_RATE_TAIL} AS tail,
                   GREATEST(c.now, k.promised_until) AS promised
        ) AS l
        CROSS JOIN LATERAL (
            SELECT NOT l.full AND (l.in_line OR (l.tail <= c.now AND l.promised <= c.now)) AS granted,
                   CASE WHEN l.in_line
                        THEN COALESCE((SELECT min(s.at) + {_RATE_WINDOW} FROM unnest(w.kept) AS s(at)
                                       WHERE s.at + {_RATE_WINDOW} > l.promised),
                                      l.promised + {_RATE_STEP})
                        ELSE GREATEST(l.tail, CASE WHEN l.full THEN l.frees END, l.promised + {_RATE_STEP}) END
                       AS sent_to
        ) AS d
    )
    RETURNING k.granted, k.decided_at, k.retry_at
), started AS (
    UPDATE tasks_task AS t SET
        attempt_started = true,
        attempt_isolated = %(isolated)s::boolean,
        attempts = t.attempts + 1,
        started_at = COALESCE(t.started_at, s.decided_at),
        last_attempted_at = s.decided_at,
        worker_ids = t.worker_ids || jsonb_build_array(t.holder)
    FROM mine AS m, slot AS s
    WHERE t.id = m.id AND s.granted
    RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
), refused AS (
    UPDATE tasks_task AS t SET
        status = {WAITING_STATUS},
        run_after = s.retry_at,
        rate_refusals = t.rate_refusals + 1,
        snoozed_at = NULL,  -- it waits for its key's next start now, not a wake time
        attempt_started = false,
        attempt_isolated = false,
        released_at = clock_timestamp(),
        expires_at = LEAST(t.expires_at, clock_timestamp())
    FROM mine AS m, slot AS s
    WHERE t.id = m.id AND NOT s.granted
    RETURNING t.id, t.token, t.run_after
)
SELECT true, id, token, attempts, started_at, last_attempted_at, NULL::float8 FROM started
UNION ALL  -- with the seconds until it is due: the worker looks for it then (it was not NOTIFYed)
SELECT false, id, token, NULL, NULL, run_after, EXTRACT(EPOCH FROM run_after - clock_timestamp())::float8 FROM refused
UNION ALL  -- sent again after a lost reply: the first copy granted it (nothing else starts a rate-limited claim)
SELECT true, t.id, t.token, t.attempts, t.started_at, t.last_attempted_at, NULL
FROM tasks_task AS t JOIN mine AS m ON t.id = m.id WHERE m.attempt_started
"""
