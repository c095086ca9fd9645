"""The repair sweep: a second line of defence behind the workflow settle (DESIGN.md invariant 14).

The settle of a workflow runs in the statement that makes a member final or reopens one, serialised on
the workflow (migration 0027, tasks/lifecycle/workflows.py), so a dependant never waits behind parents
that are all final and a workflow never stays RUNNING once its members are. Should a path ever leave
one so (a restore or a hand-written fix run with ``session_replication_role = replica``, which fires
no trigger; a bug), the recovery round finds it here and sets it right:

- ``dependant``: an AWAITING member whose parents are all final. It is released (READY, its parents'
  results piped in where its edge pipes them) or, when a parent failed under ``on_failure="cancel"``,
  cancelled with the reason, exactly as the settle would have.
- ``workflow``: a RUNNING workflow none of whose members is unfinished. Its counts are taken again
  from its members and it ends.

Each candidate is read, its workflow's settle lock taken alone (as a requeue takes it: a settle in
flight commits first), and read again under it, so a member caught between the statements of a settle
in progress is never "repaired". Every repair is counted in ``tasks_repair`` by kind, exported as
``tasks_repairs_total`` in ``/metrics``, and an alert rule fires on any (docs/monitoring/alerts.yml):
a repair is a bug report, and a test in which one happens fails (tests/db/test_workflow_repair.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction

logger = logging.getLogger("tasks.recovery")

#: The kinds of repair, each a series of ``tasks_repairs_total`` (zero until one happens).
REPAIR_KINDS = ("dependant", "workflow")
#: Candidates read per kind and round; the next round goes on from where this one stopped.
REPAIR_BATCH = 500

# AWAITING members none of whose parents is unfinished: read from the status index (AWAITING rows
# only), each one's edges by the child index and its parents by primary key.
_STRANDED_DEPENDANTS_SQL = """
SELECT c.id, c.workflow_id FROM tasks_task AS c
WHERE c.status = 'AWAITING' AND c.id > %(after)s
  AND NOT EXISTS (SELECT 1 FROM tasks_taskdependency AS d JOIN tasks_task AS p ON p.id = d.parent_id
                  WHERE d.child_id = c.id AND p.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))
ORDER BY c.id LIMIT %(limit)s
"""

# RUNNING workflows without an unfinished member (the member index, one probe each).
_STRANDED_WORKFLOWS_SQL = """
SELECT w.id FROM tasks_workflow AS w
WHERE w.status = 'RUNNING' AND w.id > %(after)s
  AND NOT EXISTS (SELECT 1 FROM tasks_task AS m
                  WHERE m.workflow_id = w.id AND m.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))
ORDER BY w.id LIMIT %(limit)s
"""

# The settle lock of migration 0027, taken alone, in key order (as the settle takes several).
_LOCK_WORKFLOWS_SQL = """
SELECT pg_advisory_xact_lock('tasks_workflow'::regclass::oid::integer, k.key)
FROM (SELECT DISTINCT hashint8(f) AS key FROM unnest(%(flows)s::bigint[]) AS f ORDER BY 1) AS k
"""

# Read again under the lock: only those still stranded are released or cancelled, as the settle would
# (a group's callback gets every member's result as a list, another dependant its one parent's result,
# or the list of its parents' results).
_REPAIR_DEPENDANTS_SQL = """
WITH stranded AS (
    SELECT c.id,
           COALESCE(bool_or(p.status IN ('FAILED', 'CANCELLED') AND d.on_failure = 'cancel'), false) AS doomed,
           bool_or(d.pipe) AS pipe,
           min(p.id) FILTER (WHERE p.status IN ('FAILED', 'CANCELLED') AND d.on_failure = 'cancel') AS culprit,
           bool_or(w.id IS NOT NULL) AS grouped,
           CASE WHEN count(*) = 1 THEN COALESCE((array_agg(p.return_value))[1], 'null')
                ELSE jsonb_agg(p.return_value ORDER BY p.id) END AS results,
           jsonb_agg(p.return_value ORDER BY p.id) AS all_results
    FROM tasks_task AS c
    JOIN tasks_taskdependency AS d ON d.child_id = c.id
    JOIN tasks_task AS p ON p.id = d.parent_id
    LEFT JOIN tasks_workflow AS w ON w.id = c.workflow_id AND w.kind = 'group' AND w.callback_id = c.id
    WHERE c.id = ANY(%(ids)s::bigint[]) AND c.status = 'AWAITING'
    GROUP BY c.id
    HAVING count(*) FILTER (WHERE p.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')) = 0
)
UPDATE tasks_task AS c SET
    status = CASE WHEN s.doomed THEN 'CANCELLED' ELSE 'READY' END,
    waiting_on = 0,
    finished_at = CASE WHEN s.doomed THEN clock_timestamp() ELSE c.finished_at END,
    run_after = CASE WHEN s.doomed THEN c.run_after ELSE GREATEST(c.run_after, statement_timestamp()) END,
    args = CASE WHEN NOT s.doomed AND s.pipe
                THEN jsonb_set(c.args, '{0}', CASE WHEN s.grouped THEN s.all_results ELSE s.results END)
                ELSE c.args END,
    errors = CASE WHEN s.doomed THEN c.errors || jsonb_build_array(jsonb_build_object(
                 'attempt', c.attempts, 'kind', 'dependency', 'at', clock_timestamp(),
                 'exception_class_path', 'tasks.exceptions.DependencyFailed',
                 'message', format('cancelled by the repair sweep: task %%s, which it depends on, ended'
                                   ' FAILED or CANCELLED', s.culprit),
                 'traceback', '')) ELSE c.errors END
FROM stranded AS s
WHERE c.id = s.id AND c.status = 'AWAITING'
RETURNING c.id, c.status
"""

_REPAIR_WORKFLOWS_SQL = """
UPDATE tasks_workflow AS w SET
    remaining = 0,
    callback_waiting = 0,
    failed = x.failed,
    status = CASE WHEN x.failed > 0 THEN 'FAILED' ELSE 'SUCCESSFUL' END,
    finished_at = COALESCE(x.last_finished, clock_timestamp())
FROM (SELECT m.workflow_id,
             count(*) FILTER (WHERE m.status IN ('FAILED', 'CANCELLED'))::int AS failed,
             max(m.finished_at) AS last_finished
      FROM tasks_task AS m WHERE m.workflow_id = ANY(%(ids)s::bigint[])
      GROUP BY m.workflow_id
      HAVING count(*) FILTER (WHERE m.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')) = 0) AS x
WHERE w.id = x.workflow_id AND w.status = 'RUNNING'
RETURNING w.id
"""

_COUNT_SQL = """
INSERT INTO tasks_repair (kind, count, last_at, last_task_id)
VALUES (%(kind)s, %(n)s, clock_timestamp(), %(last)s)
ON CONFLICT (kind) DO UPDATE SET count = tasks_repair.count + EXCLUDED.count, last_at = EXCLUDED.last_at,
                                 last_task_id = EXCLUDED.last_task_id
"""


@dataclass
class RepairReport:
    #: Dependants released or cancelled: (task id, the status it got).
    dependants: list[tuple[int, str]] = field(default_factory=list)
    #: Workflows ended from their members' statuses.
    workflows: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.dependants or self.workflows)


def repair_stranded(*, using: str = DEFAULT_DB_ALIAS, limit: int = REPAIR_BATCH) -> RepairReport:
    """Find and set right what waits for something that will never happen (see the module's docstring).
    Each kind reads at most ``limit`` candidates after the last one it read, until none is left."""
    report = RepairReport()
    after = 0
    while True:
        rows = _read(_STRANDED_DEPENDANTS_SQL, {"after": after, "limit": limit}, using)
        if rows:
            report.dependants += _repair(
                _REPAIR_DEPENDANTS_SQL, [r[0] for r in rows], [r[1] for r in rows if r[1] is not None], using
            )
            after = rows[-1][0]
        if len(rows) < limit:
            break
    after = 0
    while True:
        rows = _read(_STRANDED_WORKFLOWS_SQL, {"after": after, "limit": limit}, using)
        if rows:
            ids = [r[0] for r in rows]
            report.workflows += [r[0] for r in _repair(_REPAIR_WORKFLOWS_SQL, ids, ids, using)]
            after = rows[-1][0]
        if len(rows) < limit:
            break
    if report.dependants:
        _count("dependant", report.dependants[-1][0], len(report.dependants), using)
        logger.error(
            "repair: %d workflow members waited behind parents that were all final (a settle was lost;"
            " please report it): %s",
            len(report.dependants),
            ", ".join(f"task {task_id} -> {status}" for task_id, status in report.dependants[:20]),
        )
    if report.workflows:
        _count("workflow", None, len(report.workflows), using)
        logger.error(
            "repair: %d workflows were RUNNING with every member final (their counts were lost; please report it): %s",
            len(report.workflows),
            ", ".join(str(w) for w in report.workflows[:20]),
        )
    return report


def _read(sql: str, params: dict[str, int], using: str) -> list[tuple[Any, ...]]:
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def _repair(sql: str, ids: list[int], flows: list[int], using: str) -> list[tuple[Any, ...]]:
    """``sql`` on ``ids`` under the settle locks of ``flows``, in one transaction of its own."""
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        if flows:
            cursor.execute(_LOCK_WORKFLOWS_SQL, {"flows": flows})
        cursor.execute(sql, {"ids": ids})
        return cursor.fetchall()


def _count(kind: str, last: int | None, n: int, using: str) -> None:
    with connections[using].cursor() as cursor:
        cursor.execute(_COUNT_SQL, {"kind": kind, "n": n, "last": last})
