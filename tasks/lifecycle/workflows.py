"""Workflows in the database: members, edges, and what settles a dependant.

A member that depends on others is inserted AWAITING with ``waiting_on`` = its parents not yet
final. Nothing polls. The statement that makes a member final (a worker's finish, a failure for
good, recovery's last crash, an operator's cancel) also settles its dependants, in the same
transaction, through two triggers (migrations 0016 and 0017):

- an AFTER UPDATE row trigger counts a member whose status moves into or out of the final ones in a
  transaction-local counter, in its WHEN clause (``set_config``, evaluated in C as the row is
  updated), which is then false: no row event is queued and no function runs per member. A plain
  task costs the WHEN clause's first test (not a BEFORE trigger: PostgreSQL locks the old row of
  every update for one of those). A counter, not a flag: another trigger of the same statement (the
  concurrency admission) may run a nested update whose statement trigger fires first, and that one
  must leave the outer statement's moves to it (keyed members were found never settled);
- an AFTER UPDATE statement trigger, whose own WHEN clause passes only while the counter is not zero
  (a plain task's statement calls no function), reads the statement's old and new rows (its
  transition tables) once, set-based:

  1. the dependants of members that failed or were cancelled under ``on_failure="cancel"``, and
     their own such dependants down the graph (one recursive query), are cancelled with the reason;
  2. every other AWAITING dependant counts down by the parents that became final (up by those
     reopened by a requeue); at zero it becomes READY (with its parents' results prepended to its
     arguments when its edge pipes them). A keyed one then waits for its concurrency slot (BLOCKED)
     as usual. A group's callback is counted on its workflow row instead (``callback_waiting``:
     every member's finish updates that row anyway): one row update per member, not two. While
     nothing has joined a group (``callback_only``: a ``depends_on`` enqueue into its workflow
     clears it), its members' successes read no edges at all: the callback is their one dependant;
  3. a dependant an operator requeued in this statement waits for its parents again as they stand
     (AWAITING while one is not final; cancelled again if one failed under "cancel"). One cancelled
     again (or down the graph from one) is counted by this statement alone, as the net of both
     (migration 0038): the nested statements' settles pass over it (``leasing.workflow_reopened``),
     since their count-down would come before this statement's count-up (issue 56);
  4. each workflow counts its members down; at zero it ends (SUCCESSFUL, FAILED if a member failed
     or was cancelled, CANCELLED if an operator cancelled it) with ``finished_at`` on the database
     clock. A group whose callback countdown reaches zero releases the callback.

Every statement takes member rows before workflow rows, and dependants and workflows in id order (a
dependant's id is always larger than its parents'): finishes, an operator's cancel
(``WorkflowQuerySet.cancel``) and retention (``PRUNE_WORKFLOWS_SQL``, members first, SKIP LOCKED)
never wait for each other in a cycle. Exactly once: a member becomes final in exactly
one statement (every finish is a compare-and-set on the attempt), and that statement's trigger is
the only one that counts it. The last member's statement releases the callback; no other can.

Dependencies exist only within one database (a workflow's members are routed by their queues, and
every queue of a workflow must live in the same database).
"""

from __future__ import annotations

import graphlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import models

from tasks.exceptions import UnstorableResult
from tasks.lifecycle.steps import forget_steps_ctes
from tasks.lifecycle.storable import storable_json

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
    if all(0 <= up < node for node, ups in parents.items() for up in ups):
        return list(range(size))  # every step after its parents (a chain, a group): no cycle possible
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
RESERVE_IDS_SQL = "SELECT nextval(pg_get_serial_sequence('tasks_task', 'id')) FROM generate_series(1, %(n)s::int)"

# The workflow's row, RUNNING, with every member counted as remaining; its callback (if any) waits
# for callback_waiting members. The members and edges follow in the same transaction.
CREATE_WORKFLOW_SQL = """
INSERT INTO tasks_workflow (name, kind, status, total, remaining, failed, callback_id, callback_waiting, callback_only,
                            created_at)
VALUES (%(name)s::text, %(kind)s::text, 'RUNNING', %(total)s::int, %(total)s::int, 0, %(callback)s::bigint,
        %(callback_waiting)s::int, %(callback_only)s::boolean, statement_timestamp())
RETURNING id, created_at
"""

# Every member in one statement (a group of 10,000 is one insert). What members share (queue,
# priority, path, options: a group's members share all of it) is sent once per distinct set, as
# arrays ("templates"); what each has of its own is one JSON document: [template, waiting_on, args,
# kwargs] per member, encoded by Python's C encoder in one call and parsed by the server, where
# 12 arrays of 10,000 elements were each dumped element by element in Python. AWAITING rows are
# invisible to the claim (they are not in its index); a keyed READY row becomes BLOCKED in its
# insert trigger, as for any enqueue. A waiting_on of -1 is a group's callback: AWAITING with
# waiting_on 0, counted down on its workflow row (remaining), not on its own.
INSERT_MEMBERS_SQL = """
INSERT INTO tasks_task (id, queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts,
                        max_attempts, timeout, dedup_key, errors, worker_ids, renewals, transitions, failures,
                        crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated,
                        backend_alias, task_run_after, concurrency_key, concurrency_limit, workflow_id,
                        waiting_on, rate_key, rate_limit, rate_period, trace_context, fair_key)
SELECT (%(ids)s::bigint[])[m.n], t.queue, t.priority, t.task_path, m.item -> 2, m.item -> 3,
       CASE WHEN (m.item ->> 1)::int <> 0 THEN 'AWAITING' ELSE 'READY' END,
       COALESCE(t.run_after, statement_timestamp()), statement_timestamp(), 0, t.max_attempts, t.timeout, NULL,
       '[]'::jsonb, '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false, t.backend_alias,
       CASE WHEN t.backend_alias IS NULL THEN NULL ELSE t.run_after END,
       t.concurrency_key, t.concurrency_limit, %(workflow)s::bigint, GREATEST((m.item ->> 1)::int, 0),
       t.rate_key, t.rate_limit, t.rate_period, %(trace_context)s::jsonb, t.fair_key
FROM jsonb_array_elements(%(members)s::jsonb) WITH ORDINALITY AS m(item, n)
JOIN unnest(%(queues)s::text[], %(priorities)s::smallint[], %(paths)s::text[], %(run_afters)s::timestamptz[],
            %(max_attempts)s::int[], %(timeouts)s::float8[], %(backend_aliases)s::text[], %(keys)s::text[],
            %(limits)s::int[], %(rate_keys)s::text[], %(rate_limits)s::int[], %(rate_periods)s::float8[],
            %(fair_keys)s::text[])
     WITH ORDINALITY AS t(queue, priority, task_path, run_after, max_attempts, timeout, backend_alias,
                          concurrency_key, concurrency_limit, rate_key, rate_limit, rate_period, fair_key, k)
  ON t.k = (m.item ->> 0)::int + 1
ORDER BY m.n
"""

# Every edge in one statement: one JSON document, [child id, on_failure, pipe, [parent ids]] per child.
INSERT_EDGES_SQL = """
INSERT INTO tasks_taskdependency (parent_id, child_id, on_failure, pipe)
SELECT p.value::bigint, (e.item ->> 0)::bigint, e.item ->> 1, (e.item ->> 2)::boolean
FROM jsonb_array_elements(%(edges)s::jsonb) AS e(item), jsonb_array_elements_text(e.item -> 3) AS p(value)
"""

#: What members share, sent once per distinct set (INSERT_MEMBERS_SQL): member key -> parameter.
TEMPLATE_COLUMNS = {
    "queue": "queues",
    "priority": "priorities",
    "task_path": "paths",
    "run_after": "run_afters",
    "max_attempts": "max_attempts",
    "timeout": "timeouts",
    "backend_alias": "backend_aliases",
    "concurrency_key": "keys",
    "concurrency_limit": "limits",
    "rate_key": "rate_keys",
    "rate_limit": "rate_limits",
    "rate_period": "rate_periods",
    "fair_key": "fair_keys",  # a fair queue's member has one ("" when none was given), others None
}

#: The member keys a member may leave out (None).
OPTIONAL_COLUMNS = frozenset({"rate_key", "rate_limit", "rate_period", "fair_key"})


def member_params(
    workflow: int, ids: list[int], members: Sequence[Mapping[str, Any]], trace_context: str | None = None
) -> dict[str, Any]:
    """INSERT_MEMBERS_SQL's parameters for ``members`` (dicts of TEMPLATE_COLUMNS' keys (the
    OPTIONAL_COLUMNS may be left out), ``waiting_on``,
    and ``args`` / ``kwargs`` as Python values) with the ids reserved for them, every one carrying
    ``trace_context`` (the enqueuing span's, as JSON text: tasks/tracing.py; None: tracing off). Raises
    :class:`~tasks.exceptions.UnstorableResult` naming the first member whose arguments jsonb
    cannot hold."""
    templates: dict[tuple[Any, ...], int] = {}
    entries = []
    for member in members:
        shared = tuple(member.get(key) if key in OPTIONAL_COLUMNS else member[key] for key in TEMPLATE_COLUMNS)
        index = templates.setdefault(shared, len(templates))
        entries.append([index, member["waiting_on"], member["args"], member["kwargs"]])
    try:
        payload = storable_json(entries)
    except UnstorableResult:
        for number, member in enumerate(members):
            try:
                storable_json([member["args"], member["kwargs"]])
            except UnstorableResult as exc:
                raise UnstorableResult(f"step {number}'s arguments: {exc}") from None
        raise
    params: dict[str, Any] = {"workflow": workflow, "ids": ids, "members": payload, "trace_context": trace_context}
    for position, name in enumerate(TEMPLATE_COLUMNS.values()):
        params[name] = [shared[position] for shared in templates]
    return params


def edge_params(edges: Iterable[tuple[int, str, bool, Sequence[int]]]) -> dict[str, Any]:
    """INSERT_EDGES_SQL's parameter: (child id, on_failure, pipe, parent ids) per child."""
    return {"edges": json.dumps([[child, policy, pipe, list(parents)] for child, policy, pipe, parents in edges])}


# An enqueue that names existing tasks as parents: they are locked (in id order) until the enqueue
# commits, so a parent cannot finish unseen between this look and the dependant's insert (its
# finishing statement waits for the lock and then sees the new edge).
LOCK_PARENTS_SQL = """
SELECT id, status, workflow_id FROM tasks_task WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR NO KEY UPDATE
"""

# What the parents returned, in id order: a dependant's inputs when it is enqueued with its values.
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
# new member is final, and a group's members may now have a dependant besides its callback.
JOIN_WORKFLOW_SQL = """
UPDATE tasks_workflow SET
    callback_only = false,
    total = total + 1,
    remaining = remaining + 1,
    status = CASE WHEN status <> 'CANCELLED' THEN 'RUNNING' ELSE status END,
    finished_at = NULL
WHERE id = %(workflow)s::bigint
"""

# An operator's cancel of a workflow, once its unfinished members are cancelled (they ended it, FAILED
# with their cancellations counted): it is CANCELLED.
MARK_CANCELLED_SQL = """
UPDATE tasks_workflow SET status = 'CANCELLED' WHERE id = ANY(%(ids)s::bigint[]) RETURNING id
"""

# How many members a group's callback still waits for (Task.parents_left), from its workflow's row;
# no row when the task is not that workflow's callback.
CALLBACK_WAITING_SQL = "SELECT callback_waiting FROM tasks_workflow WHERE id = %(id)s AND callback_id = %(task)s"

# The parents of a task, with what they returned: for a callback or a dependant reading its inputs
# (a finish time of infinity or -infinity, a hand edit, as none: FiniteDateTimeField, tasks/models/task.py).
PARENTS_SQL = """
SELECT p.id, p.status, p.task_path, p.return_value, p.errors,
       CASE WHEN isfinite(p.finished_at) THEN p.finished_at END AS finished_at
FROM tasks_taskdependency AS d JOIN tasks_task AS p ON p.id = d.parent_id
WHERE d.child_id = %(id)s
ORDER BY p.id
"""

# Members of one workflow per status (the workflow page and the API), through
# tasks_task_workflow_idx (workflow_id, status).
MEMBER_COUNTS_SQL = "SELECT status, count(*) FROM tasks_task WHERE workflow_id = %(id)s GROUP BY status"

# Retention: finished workflows of one status older than the age, a batch at a time, with their
# members and edges (one statement: the unit goes at once or not at all). Locks are taken in the
# order every finishing statement takes them: members first (in id order, SKIP LOCKED: a member an
# operator is requeueing right now is passed over), then the workflows whose members are all held
# and final (SKIP LOCKED too, status re-checked); the rest wait for the next pass. The members' steps
# and events go with them (forget_steps_ctes).
PRUNE_WORKFLOWS_SQL = f"""
WITH candidates AS MATERIALIZED (
    SELECT id FROM tasks_workflow
    WHERE status = %(status)s AND finished_at IS NOT NULL
      AND finished_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (finished_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY finished_at, id
    LIMIT %(limit)s
), held AS MATERIALIZED (
    SELECT t.id, t.workflow_id FROM tasks_task AS t JOIN candidates AS c ON t.workflow_id = c.id
    WHERE t.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
    ORDER BY t.id
    FOR UPDATE OF t SKIP LOCKED
), whole AS MATERIALIZED (
    SELECT c.id FROM candidates AS c
    WHERE (SELECT count(*) FROM tasks_task AS t WHERE t.workflow_id = c.id)
        = (SELECT count(*) FROM held AS h WHERE h.workflow_id = c.id)
), picked AS MATERIALIZED (
    SELECT w.id FROM tasks_workflow AS w JOIN whole ON whole.id = w.id
    WHERE w.status = %(status)s AND w.finished_at IS NOT NULL
    ORDER BY w.id
    FOR UPDATE OF w SKIP LOCKED
), members AS MATERIALIZED (
    SELECT h.id FROM held AS h JOIN picked ON picked.id = h.workflow_id
), gone_edges AS (
    -- Both ends of an edge are members of one workflow: its children's edges are all of them.
    DELETE FROM tasks_taskdependency AS d USING members WHERE d.child_id = members.id
), gone_members AS (
    DELETE FROM tasks_task AS t USING members WHERE t.id = members.id RETURNING t.id
), {forget_steps_ctes("gone_members")}
DELETE FROM tasks_workflow AS w USING picked
WHERE w.id = picked.id
RETURNING w.finished_at, w.id, (SELECT count(*) FROM gone_members)
"""
