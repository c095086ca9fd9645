"""What holds the waiting tasks (issue 56): the Ready count broken down by reason, so that "706 Ready"
beside "no runnable tasks" and idle workers says why.

Each Ready task is counted under one reason, the first that holds it: its queue is paused; it waits
in a rate key's line (refused a start, ``run_after`` at its reserved start); its handler snoozed it;
it backs off after a failure; its run after is in the future (scheduled, or a debounce); else it is
runnable now. Blocked (a concurrency key at its limit) and Awaiting (a dependency not finished) are
statuses of their own, counted by the overview's cards.

One statement, one clock (``statement_timestamp()``), each part an ordered index scan that stops at
``COUNT_CAP`` + 1 entries (invariant 12): the paused queues' rows and the runnable ones from the claim
index (per queue and priority level: ``run_after`` is then a range of it), a rate key's line from
tasks_task_rate_line_idx (keys found by a loose index scan, the first ``SHOWN_KEYS`` by name),
snoozed and retrying rows from their own partial indexes. "Scheduled" is what is left of the Ready
count; it is not known once any part is capped or the keys or queues were cut short.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from django.db import connections
from django.template.defaultfilters import pluralize
from django.utils import timezone

from leasing.pagination import COUNT_CAP, Count
from leasing.routing import selected_database
from leasing.templatetags.leasing_tags import stamp
from tasks.lifecycle.ratelimits import QUEUE_KEY_PREFIX, queue_rates
from tasks.lifecycle.states import TaskStatus
from tasks.models import QueueControl
from tasks.web.queries import QUEUE_LIMIT

#: Rate keys whose lines are counted (the first by name); the rest make "scheduled" unknown.
SHOWN_KEYS = 50

# A row is held by a rate key's line when it was refused a start (``rate_refusals``) and is due later,
# under a key of its own or its queue's (LEASING_TASKS["RATE_LIMITS"]): the predicate every part below
# uses to leave such rows to the rate part, so that each row is counted once.
_RATE_HELD = (
    "({t}.rate_refusals > 0 AND {t}.run_after > statement_timestamp()"
    " AND ({t}.rate_key IS NOT NULL OR {t}.queue = ANY(%(rated)s::text[])))"
)

# What holds the waiting tasks back, for the dashboard: one statement of bounded parts (the queues with
# Ready rows by a loose index scan, then per queue its paused switch, key slots, rate lines and
# dependencies), each part capped so that its cost does not grow with the table.
HOLDS_SQL = f"""
WITH RECURSIVE waiting(queue) AS (
    -- The queues with Ready rows: a loose index scan of tasks_task_claim_idx, one descent per queue.
    (SELECT queue FROM tasks_task WHERE status = 'READY' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM tasks_task AS t WHERE t.status = 'READY' AND t.queue > waiting.queue
            ORDER BY t.queue LIMIT 1)
    FROM waiting WHERE waiting.queue IS NOT NULL
), queues AS MATERIALIZED (
    SELECT queue FROM waiting WHERE queue IS NOT NULL LIMIT %(queues)s + 1
), levels(queue, priority) AS (
    -- Each unpaused queue's priorities (the same scan, one descent per level): within a level the
    -- claim index is in run_after order, so "runnable now" is a range of it.
    SELECT q.queue, (SELECT t.priority FROM tasks_task AS t WHERE t.status = 'READY' AND t.queue = q.queue
                     ORDER BY t.priority DESC LIMIT 1)
    FROM (SELECT queue FROM queues LIMIT %(queues)s) AS q WHERE q.queue <> ALL(%(paused)s::text[])
    UNION ALL
    SELECT levels.queue, (SELECT t.priority FROM tasks_task AS t
                          WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority < levels.priority
                          ORDER BY t.priority DESC LIMIT 1)
    FROM levels WHERE levels.priority IS NOT NULL
), keys(rate_key) AS (
    -- The rate keys with waiting rows: a loose index scan of tasks_task_rate_line_idx.
    (SELECT rate_key FROM tasks_task WHERE rate_key IS NOT NULL AND status IN ('READY', 'BLOCKED')
     ORDER BY rate_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.rate_key FROM tasks_task AS t
            WHERE t.rate_key IS NOT NULL AND t.status IN ('READY', 'BLOCKED') AND t.rate_key > keys.rate_key
            ORDER BY t.rate_key LIMIT 1)
    FROM keys WHERE keys.rate_key IS NOT NULL
), lines(key, held, seen, next_due, last_due) AS (
    -- A key's rows due later, in its line's order (tasks_task_rate_line_idx: rate_key, run_after),
    -- at most cap + 1 of them; and its last due (one backward probe).
    SELECT k.rate_key, h.held, h.seen, h.next_due,
           (SELECT t.run_after FROM tasks_task AS t WHERE t.rate_key = k.rate_key AND t.status IN ('READY', 'BLOCKED')
            ORDER BY t.run_after DESC LIMIT 1)
    FROM (SELECT rate_key FROM keys WHERE rate_key IS NOT NULL LIMIT %(keys)s) AS k
    CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE w.status = 'READY' AND w.rate_refusals > 0
                                  AND w.queue <> ALL(%(paused)s::text[])) AS held,
               count(*) AS seen, min(w.run_after) AS next_due
        FROM (SELECT t.status, t.rate_refusals, t.queue, t.run_after FROM tasks_task AS t
              WHERE t.rate_key = k.rate_key AND t.status IN ('READY', 'BLOCKED')
                AND t.run_after > statement_timestamp()
              ORDER BY t.run_after LIMIT %(cap)s + 1) AS w
    ) AS h
    UNION ALL
    -- A queue-wide key's rows (no key of their own): the queue's Ready rows in claim order, at most cap + 1.
    SELECT %(prefix)s || q.name, h.held, h.seen, h.next_due, h.last_due
    FROM unnest(%(rated)s::text[]) AS q(name)
    CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE w.rate_key IS NULL AND w.rate_refusals > 0
                                  AND w.run_after > statement_timestamp()) AS held,
               count(*) AS seen,
               min(w.run_after) FILTER (WHERE w.rate_key IS NULL AND w.rate_refusals > 0
                                          AND w.run_after > statement_timestamp()) AS next_due,
               max(w.run_after) FILTER (WHERE w.rate_key IS NULL AND w.rate_refusals > 0
                                          AND w.run_after > statement_timestamp()) AS last_due
        FROM (SELECT t.rate_key, t.rate_refusals, t.run_after FROM tasks_task AS t
              WHERE t.status = 'READY' AND t.queue = q.name
              ORDER BY t.priority DESC, t.run_after, t.id LIMIT %(cap)s + 1) AS w
    ) AS h
    WHERE q.name <> ALL(%(paused)s::text[])
)
SELECT 'total', NULL, count(*), count(*), NULL::timestamptz, NULL::timestamptz
FROM (SELECT 1 FROM tasks_task WHERE status >= 'READY' AND status <= 'READY'
      ORDER BY status, id DESC LIMIT %(cap)s + 1) AS s
UNION ALL
SELECT 'queues', NULL, count(*), count(*), NULL, NULL FROM queues
UNION ALL
SELECT 'runnable', NULL, count(*), count(*), NULL, NULL
FROM (SELECT 1 FROM levels AS l
      CROSS JOIN LATERAL (SELECT 1 FROM tasks_task AS t
                          WHERE t.status = 'READY' AND t.queue = l.queue AND t.priority = l.priority
                            AND t.run_after <= statement_timestamp()
                          ORDER BY t.run_after LIMIT %(cap)s + 1) AS r
      WHERE l.priority IS NOT NULL
      LIMIT %(cap)s + 1) AS s
UNION ALL
SELECT 'paused', p.name, w.n, w.n, NULL, NULL
FROM unnest(%(paused)s::text[]) AS p(name)
CROSS JOIN LATERAL (SELECT count(*) AS n FROM (SELECT 1 FROM tasks_task AS t
                                               WHERE t.status = 'READY' AND t.queue = p.name
                                               ORDER BY t.priority DESC, t.run_after, t.id
                                               LIMIT %(cap)s + 1) AS c) AS w
UNION ALL
SELECT 'keys', NULL, count(*), count(*), NULL, NULL FROM (SELECT 1 FROM keys WHERE rate_key IS NOT NULL
                                                          LIMIT %(keys)s + 1) AS k
UNION ALL
SELECT 'rate', l.key, l.held, l.seen, l.last_due,
       -- When the key's window frees its next start (now, while it is not full).
       (SELECT CASE WHEN cardinality(w.kept) >= r.max_starts
                    THEN w.kept[cardinality(w.kept) - r.max_starts + 1] + make_interval(secs => r.period)
                    ELSE statement_timestamp() END
        FROM tasks_ratelimit AS r
        CROSS JOIN LATERAL (SELECT COALESCE(array_agg(s.at ORDER BY s.at), '{{}}') AS kept
                            FROM unnest(r.starts) AS s(at)
                            WHERE s.at > statement_timestamp() - make_interval(secs => r.period)) AS w
        WHERE r.key = l.key)
FROM lines AS l
UNION ALL
-- Snoozed and retrying rows from their own partial indexes (newest first, at most cap + 1 each), less
-- those a reason before them holds.
SELECT 'snoozed', NULL, count(*) FILTER (WHERE w.run_after > statement_timestamp() AND NOT w.paused AND NOT w.rated),
       count(*), NULL, NULL
FROM (SELECT t.run_after, t.queue = ANY(%(paused)s::text[]) AS paused, {_RATE_HELD.format(t="t")} AS rated
      FROM tasks_task AS t WHERE t.status = 'READY' AND t.snoozed_at IS NOT NULL
      ORDER BY t.id DESC LIMIT %(cap)s + 1) AS w
UNION ALL
SELECT 'backoff', NULL, count(*) FILTER (WHERE w.run_after > statement_timestamp() AND NOT w.paused AND NOT w.rated),
       count(*), NULL, NULL
FROM (SELECT t.run_after, t.queue = ANY(%(paused)s::text[]) AS paused, {_RATE_HELD.format(t="t")} AS rated
      FROM tasks_task AS t
      WHERE t.status = 'READY' AND t.snoozed_at IS NULL AND (t.failures > 0 OR t.crashes > 0 OR t.shared_crashes > 0)
      ORDER BY t.id DESC LIMIT %(cap)s + 1) AS w
"""


@dataclass(frozen=True)
class Hold:
    """One reason and the Ready tasks it holds."""

    reason: str  # "rate", "paused", "snoozed", "backoff", "scheduled", "runnable"
    count: Count
    #: The rate key or the paused queue.
    name: str = ""
    #: A rate key's next free start (its window's), and when its line's last task is due.
    next_free: dt.datetime | None = None
    last_due: dt.datetime | None = None


@dataclass(frozen=True)
class Holds:
    """The Ready count, and what holds it, reason by reason (those holding none left out)."""

    ready: Count
    runnable: Count
    holds: list[Hold] = field(default_factory=list)
    #: More rate keys (or queues) than were looked at: the breakdown names the first ones only.
    cut_short: bool = False

    @property
    def held(self) -> list[Hold]:
        return [hold for hold in self.holds if hold.reason != "runnable"]


def _count(n: int, seen: int, cap: int) -> Count:
    """A part's count: capped when its window read more than ``cap`` rows (a lower bound then)."""
    return Count(min(n, cap), seen > cap)


def paused_queues(using: str | None = None) -> list[str]:
    """The paused queues (the control table: a row per queue ever paused)."""
    return QueueControl.objects.using(using or selected_database()).paused_names()


def waiting_holds(*, using: str | None = None, cap: int = COUNT_CAP) -> Holds:
    """What holds the Ready tasks of the selected database (one statement; see the module's doc)."""
    using = using or selected_database()
    paused = paused_queues(using)
    params: dict[str, Any] = {
        "paused": paused,
        "rated": sorted(queue_rates()),
        "prefix": QUEUE_KEY_PREFIX,
        "cap": cap,
        "queues": QUEUE_LIMIT,
        "keys": SHOWN_KEYS,
    }
    with connections[using].cursor() as cursor:
        cursor.execute(HOLDS_SQL, params)
        rows = cursor.fetchall()
    scalars = {kind: (n, seen) for kind, _, n, seen, _, _ in rows if kind not in ("paused", "rate")}
    ready = _count(*scalars["total"], cap)
    runnable = _count(*scalars["runnable"], cap)
    cut_short = scalars["queues"][0] > QUEUE_LIMIT or scalars["keys"][0] > SHOWN_KEYS
    holds = [
        Hold("paused", _count(n, seen, cap), name=name) for kind, name, n, seen, _, _ in rows if kind == "paused" and n
    ]
    holds += sorted(
        (
            Hold("rate", _count(n, seen, cap), name=name, last_due=last, next_free=free)
            for kind, name, n, seen, last, free in rows
            if kind == "rate" and n
        ),
        key=lambda hold: (-hold.count.value, hold.name),
    )
    # A rate key's window that stopped at its cap having seen none of its Ready rows held (cap + 1 of
    # its Blocked rows due first) names no line, yet its Ready rows behind them are not known.
    lines_capped = any(kind == "rate" and seen > cap for kind, _, _, seen, _, _ in rows)
    for reason in ("snoozed", "backoff"):
        n, seen = scalars[reason]
        if n:
            holds.append(Hold(reason, _count(n, seen, cap)))
    # Scheduled: the rest of the Ready count, not known once a part stopped at its cap (a rate key's
    # window reads its Blocked rows too) or keys or queues were cut short.
    if ready.capped or cut_short or runnable.capped or lines_capped or any(hold.count.capped for hold in holds):
        holds.append(Hold("scheduled", Count(0, True)))
    elif (scheduled := ready.value - runnable.value - sum(hold.count.value for hold in holds)) > 0:
        holds.append(Hold("scheduled", Count(scheduled, False)))
    return Holds(ready=ready, runnable=runnable, holds=holds, cut_short=cut_short)


@dataclass(frozen=True)
class RowContext:
    """What a listed row's reason needs, read once per page: the paused queues, the queue-wide keys."""

    paused: frozenset[str]
    rated: frozenset[str]

    @classmethod
    def read(cls, using: str | None = None) -> RowContext:
        return cls(frozenset(paused_queues(using)), frozenset(queue_rates()))


def row_reason(task: Any, context: RowContext) -> str:
    """What holds one waiting task (for a Ready one, the first reason, as the breakdown counts it),
    for its row: empty when it is runnable now or not waiting. Judged at the database's clock of the
    read that listed it. Reads nothing: the row's own columns and ``context``."""
    if task.status == TaskStatus.AWAITING:
        left = task.waiting_on
        # A group's callback counts its parents on its workflow row (Task.parents_left: a query).
        return f"waiting on {left} task{pluralize(left)} it depends on" if left else "waiting on its workflow's tasks"
    if task.status == TaskStatus.BLOCKED:
        return f"waiting for a slot of concurrency key {task.concurrency_key}" if task.concurrency_key else ""
    if task.status != TaskStatus.READY:
        return ""
    now = task.__dict__.get("db_now") or timezone.now()
    due = task.run_after
    if task.queue in context.paused:
        return "held: its queue is paused"
    later = due is not None and due > now
    if later and task.rate_refusals and (task.rate_key or task.queue in context.rated):
        key = task.rate_key or QUEUE_KEY_PREFIX + task.queue
        return f"held by rate key {key}: its start is reserved for {stamp(due)}"
    if not later:
        return ""
    if task.snoozed_at is not None:
        return ""  # the row says "snoozed, wakes …" already
    if task.failures or task.crashes or task.shared_crashes:
        return f"backing off after a failure: due {stamp(due)}"
    return f"scheduled: due {stamp(due)}"
