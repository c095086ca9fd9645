"""Uniqueness over a window, and debounce: what a dedup key can promise beyond "one unfinished task".

A plain ``dedup_key`` collides only with an unfinished task of the key (ENQUEUE_DEDUP_SQL). Two
windows extend it, each chosen per call (``Task.objects.enqueue``), per task path (a django.tasks
backend's ``OPTIONS["unique"]`` / ``OPTIONS["debounce"]``) or per request (``POST /api/tasks``):

- **unique for a period** (``unique_for=seconds``): no second task of the key is accepted within
  that long of the last *accepted* enqueue, finished or not, on the database clock. A duplicate
  inserts nothing and returns the task that opened the window (``created`` False). While an
  unfinished task holds the key the dedup promise still holds (a window extends it, never shortens
  it). The window is a row of ``tasks_uniquekey`` (ENQUEUE_UNIQUE_SQL): an upsert that fires only
  once the key's window has passed, and the insert of the task only if it did, in one statement. The
  window starts when the enqueue is accepted: any wait for the key comes before the clock is read.
  Rows whose window passed are deleted by retention (``UNIQUE_KEYS``).
- **debounce** (``debounce=seconds``, optionally ``max_wait=seconds``): the task starts ``debounce``
  seconds after the *last* enqueue of the key, not the first. While a task of the key waits (not
  claimed yet), another enqueue of the key replaces its arguments and pushes its start to now +
  ``debounce``, never past its first enqueue + ``max_wait``; once it is claimed (or finished), the
  next enqueue of the key inserts a new task. One upsert on the task table (ENQUEUE_DEBOUNCE_SQL)
  whose arbiter, a partial unique index over waiting rows never claimed, a claim leaves for good: a
  claimed attempt's arguments never change, and a claimed task that waits again (a retry, a
  hand-back) runs with its own arguments beside the key's newer task. A keyed task already admitted
  to its concurrency key's slots that a debounce pushes later gives its slot up (it waits BLOCKED) in
  the same statement, so the key's other tasks are not held back by a task that cannot start yet.

Both run in the caller's transaction (a rollback leaves no task and no window) and cost an index
probe or two whatever the number of keys or finished rows. A plain enqueue, and a plain dedup
enqueue, send the statements they always sent.

Why these names: ``unique_for`` reads as what it promises ("unique for 60 seconds", Oban's
``unique: [period: 60]``); ``debounce`` and ``max_wait`` are the words of lodash's
``debounce(f, wait, {maxWait})``, which every front-end developer has met: the call runs once the
calls stop for ``debounce`` seconds, and at the latest ``max_wait`` after the first.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

#: The longest window, in seconds (ten years): a longer one is a mistake, and PostgreSQL's intervals
#: and timestamps hold it with room to spare.
MAX_WINDOW_SECONDS = 10 * 365 * 86400

# A refused duplicate's answer: the task whose window is still open (a later statement, so a fresh
# snapshot sees the window another transaction opened while the enqueue waited for its lock).
OPEN_WINDOW_SQL = """
SELECT task_id FROM tasks_uniquekey WHERE key = %(key)s::text AND expires_at > clock_timestamp()
"""

# ENQUEUE_UNIQUE_SQL took the key row but its insert met a plain dedup enqueue of the key that
# committed meanwhile: give the window back (compare-and-set on the task it named, which does not
# exist), so the key's next enqueue is judged as if this one had never come.
RELEASE_UNIQUE_KEY_SQL = """
DELETE FROM tasks_uniquekey WHERE key = %(key)s::text AND task_id = %(task_id)s::bigint
"""


class WindowError(ValueError):
    """A window argument that cannot be: ``field`` names the argument to fix."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def seconds_of(name: str, value: Any) -> float | None:
    """A window's length in seconds (a number or a timedelta), or None; ValueError when malformed."""
    if value is None:
        return None
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WindowError(f"{name} must be a number of seconds (or a timedelta)", name)
    value = float(value)
    if not math.isfinite(value) or not 0 < value <= MAX_WINDOW_SECONDS:
        raise WindowError(f"{name} must be more than 0 and at most {MAX_WINDOW_SECONDS} seconds (ten years)", name)
    return value


def validate_windows(
    *,
    dedup_key: str | None,
    unique_for: float | None,
    debounce: float | None,
    max_wait: float | None,
    run_after: dt.datetime | None,
) -> None:
    """The combinations a window allows (lengths already checked by :func:`seconds_of`)."""
    if unique_for is not None and debounce is not None:
        raise WindowError(
            "give unique_for or debounce, not both: a key is either unique for a period or debounced", "debounce"
        )
    if max_wait is not None and debounce is None:
        raise WindowError("max_wait bounds a debounce: give debounce too", "max_wait")
    if (unique_for is not None or debounce is not None) and dedup_key is None:
        field = "unique_for" if unique_for is not None else "debounce"
        raise WindowError(f"{field} needs a dedup_key (the key)", field)
    if debounce is not None and run_after is not None:
        raise WindowError(
            "a debounced task starts debounce seconds after the last enqueue: give no run_after", "run_after"
        )
    if debounce is not None and max_wait is not None and max_wait < debounce:
        raise WindowError("max_wait must be at least debounce (it caps how far debounces push the start)", "max_wait")


def window_problems(entry: Any, kind: str) -> list[str]:
    """What is wrong with one task path's entry of OPTIONS["unique"] ({"key", "for"}) or
    OPTIONS["debounce"] ({"key", "delay", optional "max_wait"})."""
    allowed = {"unique": ({"key", "for"}, set()), "debounce": ({"key", "delay"}, {"max_wait"})}[kind]
    required, optional = allowed
    if not isinstance(entry, dict) or not required <= set(entry) or set(entry) - required - optional:
        names = ", ".join(repr(n) for n in sorted(required)) + (
            f" (and optionally {', '.join(repr(n) for n in sorted(optional))})" if optional else ""
        )
        return [f"give exactly {names}"]
    problems = []
    lengths: dict[str, float | None] = {}
    for name in sorted((required | optional) - {"key"}):
        try:
            lengths[name] = seconds_of(f"'{name}'", entry.get(name))
        except ValueError as exc:
            problems.append(str(exc))
    delay, max_wait = lengths.get("delay"), lengths.get("max_wait")
    if delay is not None and max_wait is not None and max_wait < delay:
        problems.append("'max_wait' must be at least 'delay'")
    return problems
