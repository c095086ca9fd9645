"""Queues as the operator sees them: which exist, how much waits and runs, which are paused.

Every query here costs the same whatever the table holds: the queues with waiting tasks come from a
loose index scan over the claim index and the blocked-page index (one probe per queue), running rows
are few (bounded by the workers' capacity), and waiting counts stop at ``COUNT_CAP``. A fair queue's
keys with waiting tasks are counted by a loose index scan too, stopped at ``KEY_CAP``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db import connections
from django.utils import timezone

from leasing.routing import selected_database
from tasks.conf import get_settings
from tasks.lifecycle.routing import queue_database
from tasks.models import QueueControl, Worker

#: Waiting counts stop here (shown as "10,000+"): counting a backlog is a scan of it.
COUNT_CAP = 10_000

#: The distinct queues of the rows in one status: a loose index scan, one probe per queue (the claim
#: index for READY, the blocked-page index for BLOCKED).
_QUEUES_IN_STATUS_SQL = """
WITH RECURSIVE q(name) AS (
    (SELECT queue FROM tasks_task WHERE status = %(status)s ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM tasks_task AS t WHERE t.status = %(status)s AND t.queue > q.name
            ORDER BY t.queue LIMIT 1)
    FROM q WHERE q.name IS NOT NULL
)
SELECT name FROM q WHERE name IS NOT NULL
"""

#: Per queue: waiting and blocked counts, capped (the running ones: _RUNNING_SQL). Each capped count reads one
#: index in its order, so the LIMIT stops the scan after ``cap`` entries whatever the plan's estimates:
#: without an order, a backlog the planner expects to be large next to the cap got a sequential scan
#: with a LIMIT, and ordered by id alone, a backward scan of the primary key: either steps over every
#: finished row (and other queues' backlogs) before the first row it counts, because a burst enqueued
#: after the history lies at the table's end. The READY count reads the claim index in claim order
#: (which no other index gives). The BLOCKED count reads the blocked-page index (queue, status, id DESC)
#: from its queue on in (queue, id DESC) order, which nothing else gives either (an equality on the
#: queue would let the primary key give "id DESC"), and counts the rows of its own queue: they come
#: first, and at most ``cap`` entries are read in all.
_COUNTS_SQL = """
SELECT n.name,
       (SELECT count(*) FROM (SELECT 1 FROM tasks_task AS t
                              WHERE t.status = 'READY' AND t.queue = n.name
                              ORDER BY t.priority DESC, t.run_after, t.id LIMIT %(cap)s) AS w),
       (SELECT count(*) FILTER (WHERE b.queue = n.name)
        FROM (SELECT t.queue FROM tasks_task AS t
              WHERE t.status = 'BLOCKED' AND t.queue >= n.name
              ORDER BY t.queue, t.id DESC LIMIT %(cap)s) AS b)
FROM unnest(%(names)s::text[]) AS n(name)
"""

#: The running tasks per queue, and so the queues that have some: one read of the running set
#: (bounded by the workers, through tasks_task_running_exp_idx), not one per queue listed.
_RUNNING_SQL = "SELECT queue, count(*) FROM tasks_task WHERE status = 'RUNNING' GROUP BY queue"


#: Keys with waiting tasks in a fair queue are counted up to here (shown as "1,000+").
KEY_CAP = 1000

#: The keys with READY tasks of a fair queue (LEASING_TASKS["FAIR_QUEUES"]), counted by the loose index
#: scan a fair claim walks (tasks_task_fair_idx: one probe per key), stopped at ``cap`` keys.
_FAIR_KEYS_SQL = """
WITH RECURSIVE k(fair_key, n) AS (
    (SELECT fair_key, 1 FROM tasks_task
     WHERE status = 'READY' AND fair_key IS NOT NULL AND queue = %(queue)s ORDER BY fair_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.fair_key FROM tasks_task AS t
            WHERE t.status = 'READY' AND t.fair_key IS NOT NULL AND t.queue = %(queue)s AND t.fair_key > k.fair_key
            ORDER BY t.fair_key LIMIT 1), k.n + 1
    FROM k WHERE k.fair_key IS NOT NULL AND k.n < %(cap)s
)
SELECT count(*) FROM k WHERE fair_key IS NOT NULL
"""


def fair_keys_waiting(queue: str, using: str | None = None) -> int:
    """How many keys of a fair queue have READY tasks, up to KEY_CAP + 1."""
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(_FAIR_KEYS_SQL, {"queue": queue, "cap": KEY_CAP + 1})
        return int(cursor.fetchone()[0])


def declared_queues(using: str) -> set[str]:
    """The queues a project declares, of database ``using`` (listed even while empty): the fair queues,
    the routed ones (LEASING_TASKS["QUEUE_DATABASES"]), those named in SCHEDULES, and those the live
    workers of that database serve (tasks_worker.queues: a handful of rows, from the live index)."""
    settings = get_settings()
    names = set(settings.FAIR_QUEUES) | set(settings.QUEUE_DATABASES)
    names |= {
        entry.get("queue") or "default"
        for entry in settings.SCHEDULES.values()
        if isinstance(entry, dict) and isinstance(entry.get("queue") or "default", str)
    }
    horizon = timezone.now() - dt.timedelta(seconds=settings.TTL * 2)
    for queues in (
        Worker.objects.using(using)
        .filter(stopped_at__isnull=True, last_seen_at__gte=horizon)
        .values_list("queues", flat=True)[:LIVE_WORKERS_READ]
    ):
        names |= {queue for queue in queues or () if isinstance(queue, str)}
    return {name for name in names if name and queue_database(name) == using}


#: Live workers whose served queues the page reads at most.
LIVE_WORKERS_READ = 1000


def queue_overview(using: str | None = None) -> list[dict[str, Any]]:
    """One entry per known queue (waiting, waiting for a concurrency slot, running, with a control
    row, or declared: :func:`declared_queues`, with zero counts while empty), by name."""
    using = using or selected_database()
    controls = {c.name: c for c in QueueControl.objects.using(using).all()}
    with connections[using].cursor() as cursor:
        names: set[str] = set()
        for status in ("READY", "BLOCKED"):
            cursor.execute(_QUEUES_IN_STATUS_SQL, {"status": status})
            names |= {row[0] for row in cursor.fetchall()}
        cursor.execute(_RUNNING_SQL)
        running_in: dict[str, int] = dict(cursor.fetchall())
        names |= set(running_in) | set(controls) | declared_queues(using)
        ordered = sorted(names)
        cursor.execute(_COUNTS_SQL, {"names": ordered, "cap": COUNT_CAP + 1})
        counts = {name: (waiting, blocked, running_in.get(name, 0)) for name, waiting, blocked in cursor.fetchall()}
    fair_queues = set(get_settings().FAIR_QUEUES)
    entries = []
    for name in ordered:
        control = controls.get(name)
        waiting, blocked, running = counts.get(name, (0, 0, 0))
        keys = fair_keys_waiting(name, using) if name in fair_queues else 0
        entries.append(
            {
                "name": name,
                "paused": bool(control and control.paused),
                "waiting": min(waiting, COUNT_CAP),
                "waiting_capped": waiting > COUNT_CAP,
                # Waiting for a slot of their concurrency key (BLOCKED): not claimable until admitted.
                "blocked": min(blocked, COUNT_CAP),
                "blocked_capped": blocked > COUNT_CAP,
                "running": running,
                # A fair queue (claims take turns between keys) and its keys with waiting tasks.
                "fair": name in fair_queues,
                "fair_keys": min(keys, KEY_CAP),
                "fair_keys_capped": keys > KEY_CAP,
                "changed_at": control.changed_at if control else None,
                "changed_by": control.changed_by if control else "",
                "reason": control.reason if control else "",
            }
        )
    return entries
