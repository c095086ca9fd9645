"""The queries behind every task page (dashboard, admin, JSON API lists, ``/metrics``) but the
listings (tasks/web/listings.py), shaped so that their cost depends on the page and not on the table
(invariant 12): the dashboard's states and their counts, the search, the queues.

Every page query sits beside the partial index it was shaped for and the plan test that holds it
(tests/db/test_page_queries.py, tests/db/test_state_count_plans.py).

- **Search** is exact: the id, a dedup key, a holder (worker id) or a task path, each an indexed
  equality. No ``LIKE '%…%'``. Search by arguments (``kwargs:{"customer": 7}``) is jsonb containment
  through an opt-in GIN index, refused while that index is absent (tasks/web/argument_search.py).
- **Counts** stop at ``COUNT_CAP`` (shown as "10,000+"), each on the index of its state read in its
  own order (:func:`status_count`); pending is waiting minus retrying and snoozed, a lower bound once more than
  ``COUNT_CAP`` tasks wait.
- **Queues** are found with a loose index scan (a recursive CTE that jumps from one queue to the next
  in an index), never ``SELECT DISTINCT queue``; depth per queue is capped like every count.

RUNNING rows are bounded by the workers (their concurrency plus claim batches), not by the history,
so conditions on them (a live or expired lease) need no index of their own.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

from django.db import connections
from django.db.models import Q, QuerySet

from leasing.pagination import COUNT_CAP, Count, bounded_count
from leasing.routing import selected_database
from tasks.models import FAILED_BEFORE, NEVER_FAILED, NOT_RUNNING_STATUSES, Task, TaskStatus
from tasks.web.argument_search import argument_lookup

#: Pending: waiting, never failed, and not snoozed by its handler.
NEVER_SNOOZED = NEVER_FAILED & Q(snoozed_at__isnull=True)
#: Queues shown (dashboard, /metrics, admin filter): the first ones by name.
QUEUE_LIMIT = 100
#: The statuses whose rows the mover takes to tasks_finished (tasks/maintenance/archive.py).
FINISHED_STATUSES = frozenset({TaskStatus.SUCCESSFUL, TaskStatus.FAILED, TaskStatus.CANCELLED})
_MAX_ID = 2**63 - 1


# One status's rows, counted up to a cap from tasks_task_state_idx (status, id DESC) read in its own
# order from the status on: no other index gives (status, id DESC), so the plan cannot be a backward
# scan of the primary key filtering on the status, which (chosen for "WHERE status = … ORDER BY id
# DESC LIMIT n" when the status is a large share of the table) stepped over every newer row of other
# statuses before the first one it counted: after a burst of a million waiting tasks, counting the
# succeeded ones read the whole burst. With an equality on the status the primary key gives "id DESC";
# with a range it does not. The range is closed on both sides (the status alone, but not an equality
# the planner could use to drop the status from the order), so the scan stops at the status's last
# entry: a status with few rows (awaiting, blocked, cancelled) costs its rows, not the cap's worth of
# the statuses after it.
_STATUS_COUNT_SQL = """
SELECT count(*)
FROM (SELECT 1 FROM tasks_task WHERE status >= %(status)s AND status <= %(status)s
      ORDER BY status, id DESC LIMIT %(limit)s) AS s
"""


# A finished status's rows in both tables, in one statement (one snapshot: a row the mover takes
# meanwhile is counted once), each side up to the cap: tasks_task's as above, tasks_finished's from
# the status's day partitions only (pruned), at most ``limit`` rows of them.
_FINISHED_COUNT_SQL = """
SELECT count(*)
FROM ((SELECT 1 FROM tasks_task WHERE status >= %(status)s AND status <= %(status)s
       ORDER BY status, id DESC LIMIT %(limit)s)
      UNION ALL
      (SELECT 1 FROM tasks_finished WHERE status = %(status)s LIMIT %(limit)s)) AS s
"""


def status_count(status: str, cap: int = COUNT_CAP) -> Count:
    """The tasks in ``status`` (of the selected database), counted up to ``cap``; a finished
    status's rows moved to tasks_finished included. Not RUNNING: tasks_task_state_idx leaves those
    rows out (the running states are counted on the running index: :func:`_state_count`)."""
    if status == TaskStatus.RUNNING:
        raise ValueError("the RUNNING rows are counted by their state (_state_count), not by status_count")
    sql = _FINISHED_COUNT_SQL if status in FINISHED_STATUSES else _STATUS_COUNT_SQL
    with connections[selected_database()].cursor() as cursor:
        cursor.execute(sql, {"status": status, "limit": cap + 1})
        value = int(cursor.fetchone()[0])
    return Count(min(value, cap), value > cap)


@dataclass(frozen=True)
class TaskState:
    """A dashboard state: one status, a condition its own index covers (``where``) and one that no
    index covers (``unindexed``: checked within a bounded window, see Listing)."""

    description: str
    status: str
    where: Q = field(default_factory=Q)
    unindexed: Q = field(default_factory=Q)
    base: Callable[[], QuerySet[Task]] = field(default=lambda: Task.objects.all())
    #: False: the page indexes of a queue or a search term (tasks_task_queue_newest_idx, …) leave this
    #: status out, so a queue or a search is checked within the scan window of the status's own
    #: index instead (a lookup branch would read and sort every row of the status).
    indexed_lookups: bool = True

    @property
    def bounded(self) -> bool:
        """RUNNING rows are few (bounded by the workers): any condition on them is cheap."""
        return self.status == TaskStatus.RUNNING

    def queryset(self) -> QuerySet[Task]:
        return self.base().filter(status=self.status).filter(self.where, self.unindexed)


STATES: dict[str, TaskState] = {
    # Retrying tasks have their own partial index (tasks_task_retry_idx); pending ones are most
    # of the waiting tasks, read newest first from the status index, the few retrying ones skipped.
    "pending": TaskState("waiting to run; never failed nor snoozed", TaskStatus.READY, unindexed=NEVER_SNOOZED),
    # Less the snoozed ones: a task is shown in one state (tasks.lifecycle.vocabulary.state_of), and
    # one its handler snoozed after a failure waits for its wake time, not a backoff.
    "retrying": TaskState(
        "failed (or lost its worker) at least once, waiting to run again",
        TaskStatus.READY,
        where=FAILED_BEFORE & Q(snoozed_at__isnull=True),
    ),
    # Snoozed by their handler (tasks.runtime.Snooze): their own partial index (tasks_task_snoozed_idx).
    # Neither pending nor retrying, whether it failed before or not. Keyed ones wait BLOCKED.
    "snoozed": TaskState(
        "snoozed by its handler: waiting for its wake time (run after)",
        TaskStatus.READY,
        where=Q(snoozed_at__isnull=False),
    ),
    # Workflow members waiting for the tasks they depend on, read from tasks_task_state_idx; no
    # queue or search index holds them (they are not written until a member is released).
    "awaiting": TaskState(
        "a workflow member waiting for the tasks it depends on", TaskStatus.AWAITING, indexed_lookups=False
    ),
    "blocked": TaskState("waiting for a free slot of its concurrency key", TaskStatus.BLOCKED),
    "running": TaskState(
        "held by a worker with a live lease", TaskStatus.RUNNING, base=lambda: Task.objects.running().active()
    ),
    "stuck": TaskState(
        "running, but the lease expired: the worker died or stalled",
        TaskStatus.RUNNING,
        base=lambda: Task.objects.stuck(),
    ),
    "succeeded": TaskState("finished successfully", TaskStatus.SUCCESSFUL),
    "failed": TaskState("out of attempts or not retryable (dead)", TaskStatus.FAILED),
    # Not an operator's only: a handler's Cancel and a failed dependency (workflows) end tasks here too.
    "cancelled": TaskState("cancelled by an operator, its handler or a failed dependency", TaskStatus.CANCELLED),
}


#: The order a bounded read of running rows takes: the running index's (tasks_task_running_exp_idx,
#: lease expiry), ids within one expiry. No index of tasks_task has the running rows in id order
#: (migrations 0044, 0045): ordered by id, such a read may be planned as a walk of the primary key from
#: the oldest task, looking for rows that have the newest ids, through the whole table. (A count needs
#: only its first key; TASK_PATHS_SQL's running part is the same order in SQL.)
RUNNING_ORDER = ("expires_at", "pk")


def _state_count(state: TaskState, cap: int) -> Count:
    """One state's count, on the index of its rows: running rows through the running index, in its
    order (lease expiry), retrying and snoozed rows through their own (id DESC), the rest by status."""
    if state.bounded:
        # No index of status holds the RUNNING rows (migration 0044): ordered by id, a count of a state
        # the planner expects thousands of (a NULL expiry and a status taken for independent, beside a
        # never-claimed backlog) was a backward scan of the primary key through the whole table.
        return bounded_count(state.queryset().order_by(RUNNING_ORDER[0]), cap)
    if state.where:
        return bounded_count(state.queryset(), cap)
    return status_count(state.status, cap)


def state_counts(cap: int = COUNT_CAP) -> dict[str, Count]:
    """Tasks per dashboard state, each counted up to ``cap`` on the state's index. Pending (no index
    of its own) is waiting minus retrying and snoozed: exact while fewer than ``cap`` tasks wait, else a lower
    bound."""
    counts = {name: _state_count(state, cap) for name, state in STATES.items() if not state.unindexed}
    waiting, retrying = status_count(TaskStatus.READY, cap), counts["retrying"]
    # Snoozed tasks are neither pending nor retrying (read from the snoozed index).
    snoozed = counts["snoozed"]
    others = retrying.value + snoozed.value
    if not waiting.capped:
        counts["pending"] = Count(max(waiting.value - others, 0), capped=False)
    else:
        counts["pending"] = Count(0 if retrying.capped or snoozed.capped else max(cap - others, 0), capped=True)
    return {name: counts[name] for name in STATES}


#: The task paths that hold a task, each read by one index probe (a loose index scan: the next path
#: after the last one found), from tasks_task's task-path index (READY and finished rows), from
#: tasks_finished's, and from the awaiting and blocked rows and the running ones (at most 5,000 of
#: each read: no task-path index holds them). At most %(limit)s paths; a cost that grows with the number of
#: distinct paths, never with the number of tasks.
TASK_PATHS_SQL = """
WITH RECURSIVE live(path) AS (
    (SELECT task_path FROM tasks_task WHERE status = ANY(%(not_running)s::text[]) ORDER BY task_path LIMIT 1)
    UNION ALL
    SELECT (SELECT t.task_path FROM tasks_task AS t
            WHERE t.status = ANY(%(not_running)s::text[]) AND t.task_path > live.path ORDER BY t.task_path LIMIT 1)
    FROM live WHERE live.path IS NOT NULL
), moved(path) AS (
    (SELECT task_path FROM tasks_finished ORDER BY task_path LIMIT 1)
    UNION ALL
    SELECT (SELECT f.task_path FROM tasks_finished AS f WHERE f.task_path > moved.path ORDER BY f.task_path LIMIT 1)
    FROM moved WHERE moved.path IS NOT NULL
)
SELECT DISTINCT path FROM (
    (SELECT path FROM live WHERE path IS NOT NULL LIMIT %(limit)s)
    UNION ALL
    (SELECT path FROM moved WHERE path IS NOT NULL LIMIT %(limit)s)
    UNION ALL
    (SELECT task_path FROM tasks_task WHERE status = ANY(%(own_way)s::text[]) ORDER BY status, id DESC LIMIT 5000)
    UNION ALL
    (SELECT task_path FROM tasks_task WHERE status = 'RUNNING' ORDER BY expires_at LIMIT 5000)
) AS paths
"""
#: How many distinct task paths a search by a path's last part looks among, and expands to.
TASK_PATHS_READ = 1000
LAST_PART_MATCHES = 5
_LAST_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def task_paths_params() -> dict[str, Any]:
    """TASK_PATHS_SQL's parameters: the statuses of the task-path index, and those read another way
    (RUNNING rows have a part of their own: no index of status holds them)."""
    return {
        "not_running": [str(status) for status in NOT_RUNNING_STATUSES],
        "own_way": [str(TaskStatus.AWAITING), str(TaskStatus.BLOCKED)],
        "limit": TASK_PATHS_READ,
    }


def paths_ending_with(term: str, using: str) -> list[str]:
    """The task paths (of tasks the database holds) whose last part is ``term`` (``send_email`` finds
    ``app.tasks.send_email``): what people type. At most :data:`LAST_PART_MATCHES`, in order."""
    if not _LAST_PART.fullmatch(term):
        return []
    with connections[using].cursor() as cursor:
        cursor.execute(TASK_PATHS_SQL, task_paths_params())
        paths = sorted(path for (path,) in cursor.fetchall() if path.rsplit(".", 1)[-1] == term and path != term)
    return paths[:LAST_PART_MATCHES]


def search_lookups(term: str, matched_paths: list[str] | None = None) -> list[Q]:
    """Exact lookups for a search term: the id, a dedup key, a holder (worker id), a task path, whole
    or by its last part (each path it names, :func:`paths_ending_with`, appended to ``matched_paths``
    when given: the page says what the term matched). Each is an equality on an indexed column; a
    term that fits none finds nothing. An argument search (``kwargs:{…}``, ``args:[…]``) is one
    containment lookup served by its opt-in GIN index (tasks/web/argument_search.py); raises
    InvalidInput when that index is absent (or the term is malformed) rather than scan the table."""
    term = term.strip()
    if not term or "\x00" in term:
        return []
    using = selected_database()
    argument = argument_lookup(term, using)
    if argument is not None:
        return [argument]
    lookups = []
    if term.isascii() and term.isdigit() and len(term) <= 19 and 0 < int(term) <= _MAX_ID:
        lookups.append(Q(pk=int(term)))
    if len(term) <= 255:
        lookups.append(Q(dedup_key=term))
    if len(term) <= 200:
        lookups.append(Q(holder=term))
    if len(term) <= 255:
        lookups.append(Q(task_path=term))
        for path in paths_ending_with(term, using):
            lookups.append(Q(task_path=path))
            if matched_paths is not None:
                matched_paths.append(path)
    return lookups


# -- queues -----------------------------------------------------------------------------------------

# Loose index scans over the claim index (tasks_task_claim_idx: queue, priority DESC, run_after, ...
# WHERE READY): each step finds the next queue name after the previous one (one index descent), so
# the cost is per queue, not per task. Per queue, the oldest waiting run_after is the smallest of the
# first entries of each priority (the same kind of scan over the few priorities in use), and the
# runnable depth is counted up to the cap, priority by priority: within one, run_after is the index's
# next column, so the count reads the due entries only, never the tasks asleep until later (without
# PostgreSQL 18's skip scan, a count over the whole queue stepped over every one of them). No index
# of its own: every index is written by every enqueue.
QUEUE_STATS_SQL = """
WITH RECURSIVE waiting(queue) AS (
    (SELECT queue FROM tasks_task WHERE status = 'READY' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM tasks_task AS t WHERE t.status = 'READY' AND t.queue > waiting.queue
            ORDER BY t.queue LIMIT 1)
    FROM waiting WHERE waiting.queue IS NOT NULL
), levels(queue, priority) AS (
    SELECT w.queue, (SELECT t.priority FROM tasks_task AS t WHERE t.status = 'READY' AND t.queue = w.queue
                     ORDER BY t.priority DESC LIMIT 1)
    FROM (SELECT queue FROM waiting WHERE queue IS NOT NULL LIMIT %(queues)s) AS w
    UNION ALL
    SELECT levels.queue, (SELECT t.priority FROM tasks_task AS t
                          WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority < levels.priority
                          ORDER BY t.priority DESC LIMIT 1)
    FROM levels WHERE levels.priority IS NOT NULL
), oldest(queue, run_after) AS (
    SELECT levels.queue, min((SELECT t.run_after FROM tasks_task AS t
                              WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority = levels.priority
                              ORDER BY t.run_after LIMIT 1))
    FROM levels WHERE levels.priority IS NOT NULL
    GROUP BY levels.queue
)
SELECT oldest.queue, depth.n, EXTRACT(EPOCH FROM statement_timestamp() - oldest.run_after)::float8
FROM oldest
CROSS JOIN LATERAL (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM levels AS l
        CROSS JOIN LATERAL (
            SELECT 1 FROM tasks_task AS t
            WHERE t.status = 'READY' AND t.queue = l.queue AND t.priority = l.priority
              AND t.run_after <= statement_timestamp()
            LIMIT %(cap)s + 1
        ) AS due
        WHERE l.queue = oldest.queue AND l.priority IS NOT NULL
        LIMIT %(cap)s + 1
    ) AS runnable
) AS depth
WHERE depth.n > 0
ORDER BY oldest.queue
"""


def _queue_names_sql() -> str:
    statuses = ", ".join(f"'{status}'" for status in NOT_RUNNING_STATUSES)
    # The same loose index scan over tasks_task_queue_newest_idx (every status but RUNNING, which
    # is the index's condition, repeated so that the planner can use it), plus the queues of the
    # running tasks (a bounded set).
    return f"""
WITH RECURSIVE named(queue) AS (
    (SELECT queue FROM tasks_task WHERE status IN ({statuses}) ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM tasks_task AS t WHERE t.status IN ({statuses}) AND t.queue > named.queue
            ORDER BY t.queue LIMIT 1)
    FROM named WHERE named.queue IS NOT NULL
)
SELECT queue FROM (
    (SELECT queue FROM named WHERE queue IS NOT NULL LIMIT %(limit)s)
    UNION
    SELECT queue FROM tasks_task WHERE status = 'RUNNING'
) AS q
ORDER BY queue
LIMIT %(limit)s
"""


def queue_stats(*, using: str | None = None, cap: int = COUNT_CAP) -> list[dict[str, Any]]:
    """Runnable depth (capped) and age of the oldest runnable task, per queue with runnable tasks."""
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(QUEUE_STATS_SQL, {"queues": QUEUE_LIMIT, "cap": cap})
        return [
            {"queue": queue, "depth": Count(min(n, cap), n > cap), "oldest_age": float(age or 0)}
            for queue, n, age in cursor.fetchall()
        ]


def queue_names(*, using: str | None = None, limit: int = QUEUE_LIMIT) -> list[str]:
    """Names of the queues that have tasks (the first ``limit`` by name)."""
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(_queue_names_sql(), {"limit": limit})
        return [row[0] for row in cursor.fetchall()]


# -- plumbing ---------------------------------------------------------------------------------------


def any_of(lookups: Sequence[Q]) -> Q:
    return reduce(operator.or_, lookups)
