"""Workflows in the database: members, edges, and what settles a dependant.

A member that depends on others is inserted AWAITING with ``waiting_on`` = its parents not yet
final. Nothing polls. The statement that makes a member final (a worker's finish, a failure for
good, recovery's last crash, an operator's cancel) also settles its dependants, in the same
transaction, through two triggers (migration 0016):

- a BEFORE UPDATE row trigger, whose WHEN clause passes only members whose status changes, marks
  the row (``settle``: 1 became SUCCESSFUL, 2 became FAILED or CANCELLED, -1 / -2 reopened from
  them by a requeue, 0 otherwise) and raises a transaction-local flag. A plain task costs the WHEN
  clause, evaluated in C;
- an AFTER UPDATE statement trigger, whose WHEN clause reads the flag, reads the statement's rows
  (its transition table) once, set-based:

  1. the dependants of members that failed or were cancelled under ``on_failure="cancel"``, and
     their own such dependants down the graph (one recursive query), are cancelled with the reason;
  2. every other AWAITING dependant counts down by the parents that became final (up by those
     reopened); at zero it becomes READY (with its parents' results prepended to its arguments when
     its edge pipes them). A keyed one then waits for its concurrency slot (BLOCKED) as usual;
  3. each workflow counts its members down; at zero it ends (SUCCESSFUL, FAILED if a member failed
     or was cancelled, CANCELLED if an operator cancelled it) with ``finished_at`` on the database
     clock.

Rows are locked in id order (dependants, then workflows) before they are written, so two finishing
statements never wait for each other in a cycle. Exactly once: a member becomes final in exactly
one statement (every finish is a compare-and-set on the attempt), and that statement's trigger is
the only one that counts it. The last member's statement releases the callback; no other can.

Dependencies exist only within one database (a workflow's members are routed by their queues, and
every queue of a workflow must live in the same database).
"""

from __future__ import annotations

import graphlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import models

ON_PARENT_FAILURE = ("cancel", "run")


class WorkflowKind(models.TextChoices):
    CHAIN = "chain", "Chain"
    GROUP = "group", "Group"
    GRAPH = "graph", "Graph"


class WorkflowStatus(models.TextChoices):
    RUNNING = "RUNNING", "Running"
    SUCCESSFUL = "SUCCESSFUL", "Successful"
    #: Every member is final and at least one FAILED or was CANCELLED (a callback that ran anyway
    #: under ``on_failure="run"`` does not make the failures go away).
    FAILED = "FAILED", "Failed"
    CANCELLED = "CANCELLED", "Cancelled"


class WorkflowError(ValueError):
    """A workflow that cannot be enqueued as given (a cycle, an unknown parent, several databases)."""


def check_graph(parents: Mapping[int, Iterable[int]], size: int) -> list[int]:
    """A topological order of members ``0 .. size-1`` given each one's parents (indexes); raises
    :class:`WorkflowError` naming a cycle, a self-dependency or an unknown member."""
    sorter: graphlib.TopologicalSorter[int] = graphlib.TopologicalSorter()
    for node in range(size):
        sorter.add(node)
    for node, ups in parents.items():
        for up in ups:
            if not 0 <= up < size:
                raise WorkflowError(f"step {node} depends on step {up}, which is not in the workflow")
            if up == node:
                raise WorkflowError(f"step {node} depends on itself")
            sorter.add(node, up)
    try:
        return list(sorter.static_order())
    except graphlib.CycleError as exc:
        cycle = " -> ".join(str(n) for n in exc.args[1])
        raise WorkflowError(f"the dependencies form a cycle: {cycle}") from None


# -- statements ---------------------------------------------------------------------------------

#: The ids a workflow's members will have, drawn before they are inserted (so that the edges can be
#: written in the same round of statements, and the callers know which id is which step).
RESERVE_IDS_SQL = "SELECT nextval(pg_get_serial_sequence('tasks_task', 'id')) FROM generate_series(1, %(n)s)"

CREATE_WORKFLOW_SQL = """
INSERT INTO tasks_workflow (name, kind, status, total, remaining, failed, callback_id, created_at)
VALUES (%(name)s, %(kind)s, 'RUNNING', %(total)s, %(total)s, 0, %(callback)s, statement_timestamp())
RETURNING id, created_at
"""

# Every member in one statement, one array per column (a group of 10,000 is one insert). AWAITING
# rows are invisible to the claim (they are not in its index); a keyed READY row becomes BLOCKED in
# its insert trigger, as for any enqueue.
INSERT_MEMBERS_SQL = """
INSERT INTO tasks_task (id, queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts,
                        max_attempts, timeout, dedup_key, errors, worker_ids, renewals, transitions, failures,
                        crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated,
                        backend_alias, task_run_after, concurrency_key, concurrency_limit, workflow_id,
                        waiting_on, settle)
SELECT m.id, m.queue, m.priority, m.task_path, m.args, m.kwargs,
       CASE WHEN m.waiting_on > 0 THEN 'AWAITING' ELSE 'READY' END,
       COALESCE(m.run_after, statement_timestamp()), statement_timestamp(), 0, m.max_attempts, m.timeout, NULL,
       '[]'::jsonb, '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false, m.backend_alias,
       CASE WHEN m.backend_alias IS NULL THEN NULL ELSE m.run_after END,
       m.concurrency_key, m.concurrency_limit, %(workflow)s::bigint, m.waiting_on, 0
FROM unnest(%(ids)s::bigint[], %(queues)s::text[], %(priorities)s::smallint[], %(paths)s::text[],
            %(args)s::jsonb[], %(kwargs)s::jsonb[], %(run_afters)s::timestamptz[], %(max_attempts)s::int[],
            %(timeouts)s::float8[], %(backend_aliases)s::text[], %(keys)s::text[], %(limits)s::int[],
            %(waiting)s::int[])
     AS m(id, queue, priority, task_path, args, kwargs, run_after, max_attempts, timeout, backend_alias,
          concurrency_key, concurrency_limit, waiting_on)
ORDER BY m.id
"""

INSERT_EDGES_SQL = """
INSERT INTO tasks_taskdependency (parent_id, child_id, on_failure, pipe)
SELECT * FROM unnest(%(parents)s::bigint[], %(children)s::bigint[], %(on_failure)s::text[], %(pipe)s::boolean[])
"""

# An enqueue that names existing tasks as parents: they are locked (in id order) until the enqueue
# commits, so a parent cannot finish unseen between this look and the dependant's insert (its
# finishing statement waits for the lock and then sees the new edge).
LOCK_PARENTS_SQL = """
SELECT id, status, workflow_id FROM tasks_task WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR NO KEY UPDATE
"""

PARENT_VALUES_SQL = "SELECT return_value FROM tasks_task WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id"

# A dependant enqueued after a parent already failed, under on_failure = 'cancel': cancelled at once,
# by an update, so that the workflow trigger counts it like any member.
CANCEL_AT_ONCE_SQL = """
UPDATE tasks_task AS c SET
    status = 'CANCELLED',
    finished_at = clock_timestamp(),
    waiting_on = 0,
    errors = c.errors || jsonb_build_array(jsonb_build_object(
        'attempt', 0, 'kind', 'dependency', 'at', clock_timestamp(),
        'exception_class_path', 'tasks.exceptions.DependencyFailed',
        'message', (SELECT format('cancelled: task %%s, which it depends on, ended %%s', p.id, p.status)
                    FROM tasks_taskdependency AS d JOIN tasks_task AS p ON p.id = d.parent_id
                    WHERE d.child_id = c.id AND p.status IN ('FAILED', 'CANCELLED')
                    ORDER BY p.id LIMIT 1),
        'traceback', ''))
WHERE c.id = %(id)s AND c.status = 'AWAITING'
"""

#: The columns of INSERT_MEMBERS_SQL, each sent as one array: member dict key -> parameter name.
MEMBER_COLUMNS = {
    "queue": "queues",
    "priority": "priorities",
    "task_path": "paths",
    "args": "args",
    "kwargs": "kwargs",
    "run_after": "run_afters",
    "max_attempts": "max_attempts",
    "timeout": "timeouts",
    "backend_alias": "backend_aliases",
    "concurrency_key": "keys",
    "concurrency_limit": "limits",
    "waiting_on": "waiting",
}


def member_params(workflow: int, ids: list[int], members: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """INSERT_MEMBERS_SQL's parameters for ``members`` (dicts of MEMBER_COLUMNS' keys; ``args`` and
    ``kwargs`` as JSON text) with the ids reserved for them."""
    params: dict[str, Any] = {"workflow": workflow, "ids": ids}
    for key, name in MEMBER_COLUMNS.items():
        params[name] = [member.get(key) for member in members]
    return params


# Parents enqueued without a workflow join the dependant's new one, counted as they stand.
ADOPT_SQL = """
WITH adopted AS (
    UPDATE tasks_task SET workflow_id = %(workflow)s::bigint
    WHERE id = ANY(%(ids)s::bigint[]) AND workflow_id IS NULL
    RETURNING status
)
UPDATE tasks_workflow AS w SET
    total = w.total + a.n,
    remaining = w.remaining + a.unfinished,
    failed = w.failed + a.bad
FROM (SELECT count(*) AS n,
             count(*) FILTER (WHERE status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')) AS unfinished,
             count(*) FILTER (WHERE status IN ('FAILED', 'CANCELLED')) AS bad
      FROM adopted) AS a
WHERE w.id = %(workflow)s::bigint
"""

# One more member in an existing workflow (a dependant enqueued later): it is open again until the
# new member is final.
JOIN_WORKFLOW_SQL = """
UPDATE tasks_workflow SET
    total = total + 1,
    remaining = remaining + %(unfinished)s::int,
    failed = failed + %(bad)s::int,
    status = CASE WHEN %(unfinished)s::int > 0 AND status <> 'CANCELLED' THEN 'RUNNING' ELSE status END,
    finished_at = CASE WHEN %(unfinished)s::int > 0 THEN NULL ELSE finished_at END
WHERE id = %(workflow)s::bigint
"""

# An operator's cancel of whole workflows: marked first (the members' cancellations then count them
# down, and a workflow marked CANCELLED stays so when it ends).
MARK_CANCELLED_SQL = """
UPDATE tasks_workflow SET status = 'CANCELLED' WHERE id = ANY(%(ids)s::bigint[]) AND status = 'RUNNING' RETURNING id
"""

# The parents of a task, with what they returned: for a callback or a dependant reading its inputs.
PARENTS_SQL = """
SELECT p.id, p.status, p.task_path, p.return_value, p.errors, p.finished_at
FROM tasks_taskdependency AS d JOIN tasks_task AS p ON p.id = d.parent_id
WHERE d.child_id = %(id)s
ORDER BY p.id
"""

# Members of one workflow per status (the workflow page and the API), through
# tasks_task_workflow_idx (workflow_id, status).
MEMBER_COUNTS_SQL = "SELECT status, count(*) FROM tasks_task WHERE workflow_id = %(id)s GROUP BY status"

# Retention: finished workflows of one status older than the age, a batch at a time, with their
# members and edges (one statement: the unit goes at once or not at all). Members are locked
# first, SKIP LOCKED, and a workflow one of whose members is locked right now waits for the next pass.
PRUNE_WORKFLOWS_SQL = """
WITH picked AS MATERIALIZED (
    SELECT id FROM tasks_workflow AS candidate
    WHERE status = %(status)s AND finished_at IS NOT NULL
      AND finished_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (finished_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY finished_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), members AS MATERIALIZED (
    SELECT t.id FROM tasks_task AS t JOIN picked ON t.workflow_id = picked.id
    WHERE t.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
    FOR UPDATE OF t
), gone_edges AS (
    -- Both ends of an edge are members of one workflow: its children's edges are all of them.
    DELETE FROM tasks_taskdependency AS d USING members WHERE d.child_id = members.id
), gone_members AS (
    DELETE FROM tasks_task AS t USING members WHERE t.id = members.id RETURNING t.id
)
DELETE FROM tasks_workflow AS w USING picked
WHERE w.id = picked.id
RETURNING w.finished_at, w.id, (SELECT count(*) FROM gone_members)
"""
