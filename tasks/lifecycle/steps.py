"""Durable steps (tasks/steps.py): a step's stored result, and the fence its transaction commits
under.

A step runs inside one transaction with what it writes, and that transaction ends with
``STEP_RECORD_SQL``: it stores the step's result only while the attempt still holds the task (its
holder, its fencing token, RUNNING, the lease not expired on the database clock), and takes a share
lock on the task's row until the commit. Recovery, a requeue or a cancel must update that row to take
the task from the attempt, so none of them can come between the check and the commit: a step either
committed while its attempt held the task, or not at all (its writes rolled back with it). A worker
paused past its TTL (SIGSTOP, a long pause, a partition) that wakes up inside a step finds no row to
fence against, and the whole step is undone.

The share lock is held only from the fence to the commit (the end of the step): the heartbeat's
renewal and the finish of the same task wait that long, never the step's own work.

A durable sleep (tasks/steps.py ``sleep``) is a step whose result is its wake time, taken on the
database clock (``SLEEP_WAKE_SQL``); each attempt that reaches it asks the same clock how long is left
(``SLEEP_REMAINING_SQL``) and snoozes that long, or goes on.

Steps are keyed by their position in the task's run (the n-th step called), with the name it was
called by: a later attempt that calls a different name at a recorded position is a code change the
stored results do not fit (``STEPS_READ_SQL`` returns them in order; tasks/steps.py refuses it).
"""

from __future__ import annotations


def forget_steps_ctes(deleted: str) -> str:
    """The WITH items that delete the steps and events of the tasks a statement deletes (``deleted``:
    the name of its CTE of deleted task rows, ``RETURNING id``). Keyed by task id with no foreign key
    (the mover keeps a task's steps), nothing else would remove them: each statement that deletes task
    rows carries these, so the tasks and their steps go together, or neither (a rolled-back delete
    keeps both). Each reads its table's unique index by its leading column (``task_id``:
    tasks_taskstep_task_position, tasks_taskevent_task_name), the ids given as one array (an InitPlan:
    the plan does not hang on an estimate of how many rows the delete returns)."""
    return f"""gone_steps AS (
    DELETE FROM tasks_taskstep AS s WHERE s.task_id = ANY(ARRAY(SELECT {deleted}.id FROM {deleted}))
), gone_events AS (
    DELETE FROM tasks_taskevent AS e WHERE e.task_id = ANY(ARRAY(SELECT {deleted}.id FROM {deleted}))
)"""


# The stored steps of a task, in the order they ran: read once by each attempt, at its first step.
STEPS_READ_SQL = """
SELECT position, name, result::text, attempt FROM tasks_taskstep WHERE task_id = %(id)s ORDER BY position
"""

# The fence: a step's result, stored only while the attempt holds the task; the row's share lock is
# held to the commit of the step's transaction. No row back: the attempt no longer holds the task and
# the step's transaction must roll back.
STEP_RECORD_SQL = """
INSERT INTO tasks_taskstep (task_id, position, name, attempt, token, result, started_at, completed_at)
SELECT t.id, %(position)s, %(name)s, %(attempt)s, t.token, %(result)s::jsonb, %(started_at)s, clock_timestamp()
FROM (
    SELECT id, token FROM tasks_task
    WHERE id = %(id)s AND holder = %(worker)s AND token = %(token)s AND status = 'RUNNING'
      AND expires_at > clock_timestamp()
    FOR SHARE
) AS t
RETURNING position
"""

# A durable sleep's wake time: the database clock plus the sleep (stored as the sleep's step).
SLEEP_WAKE_SQL = """
SELECT clock_timestamp() + make_interval(secs => %(seconds)s)
"""

# The seconds left until a durable sleep's stored wake time, on the database clock (not above zero:
# it has passed).
SLEEP_REMAINING_SQL = """
SELECT EXTRACT(EPOCH FROM (%(wake)s::timestamptz - clock_timestamp()))::float8
"""

# -- events (tasks/steps.py send_event, wait_for_event) ------------------------------------------------
# An event is stored once per (task, name): the first payload wins. A task suspended on a wait for it
# (its ``wait:<name>`` step stored, its ``event:<name>`` not: _WAITS_FOR) and waiting in the queue is
# made due at once by the send (``statement_timestamp()``, so the notify trigger wakes idle workers);
# a task that waits for something else, a backoff or a schedule is left where it is (it reads its
# events when it reaches their wait). A task RUNNING when its event comes may have looked for it
# already and be about to snooze: its event stays undelivered, and the recovery round's
# ``EVENTS_WAKE_SQL`` wakes it once it waits for it. Neither ever waits on a row another session
# holds (a worker frozen inside a step stalls nothing but its own task).

# Whether task ``t`` is suspended on a wait for the event named by the expression ``name``.
_WAITS_FOR = """EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'wait:' || {name})
      AND NOT EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'event:' || {name})"""

# The send, first: the task's row under a share lock, so that a cancel or finish in flight commits
# before the send reads it (``EVENT_SEND_SQL`` runs next, in the same transaction, on a new snapshot).
EVENT_LOCK_SQL = """
SELECT status FROM tasks_task WHERE id = %(id)s FOR SHARE
"""

# The send, to the tasks ``ids`` (one for send_event, a workflow's unfinished members for
# send_workflow_event): each waiting for this event in the queue made due, unless one of the name was
# sent to it before, and the event stored for each unfinished one in tasks_task. Returns the ids it
# was stored for; an id left out is finished, moved, absent, or had one of the name.
EVENT_SEND_SQL = f"""
WITH woken AS (
    UPDATE tasks_task AS t SET run_after = LEAST(t.run_after, statement_timestamp())
    WHERE t.id = ANY (%(ids)s::bigint[]) AND t.status IN ('READY', 'BLOCKED')
      AND {_WAITS_FOR.format(name="%(name)s")}
      AND NOT EXISTS (SELECT FROM tasks_taskevent AS e WHERE e.task_id = t.id AND e.name = %(name)s)
    RETURNING t.id
)
INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)
SELECT t.id, %(name)s, %(payload)s::jsonb, clock_timestamp(), t.id IN (SELECT id FROM woken)
FROM tasks_task AS t
WHERE t.id = ANY (%(ids)s::bigint[]) AND t.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
ORDER BY t.id
ON CONFLICT (task_id, name) DO NOTHING
RETURNING task_id
"""

# An event to every unfinished member of a workflow (tasks/steps.py send_workflow_event): the members
# under a share lock, in id order (the order a workflow's cancel and every finish lock them: no
# deadlock with either), so that a cancel or finish in flight commits first; then EVENT_SEND_SQL
# for all of them in one statement, on a new snapshot.
WORKFLOW_EVENT_LOCK_SQL = """
SELECT id FROM tasks_task
WHERE workflow_id = %(workflow)s AND status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
ORDER BY id
FOR SHARE
"""

# A wait's look: the event's payload if one was sent by its deadline (found), and the seconds left
# to the deadline on the database clock (NULL: it waits without one).
EVENT_CHECK_SQL = """
SELECT e.payload::text, e.id IS NOT NULL, EXTRACT(EPOCH FROM (%(deadline)s::timestamptz - clock_timestamp()))::float8
FROM (SELECT 1) AS one
LEFT JOIN tasks_taskevent AS e ON e.task_id = %(id)s AND e.name = %(name)s
    AND e.sent_at <= COALESCE(%(deadline)s::timestamptz, 'infinity')
"""

# The recovery round: the undelivered events of tasks not RUNNING (rows no other session holds, and
# tasks no other session holds: a held one is left for a later round). A task suspended on the wait
# for one is made due; every one looked at is delivered (a task that waits for something else reads
# its events when it reaches their wait; a finished or moved task never will). Each read is by key:
# the undelivered events' partial index in id order, each task's status probed by its primary key,
# the batch's tasks and events by ``= ANY`` of their ids (joins here were planned as sequential scans
# of tasks_task and tasks_taskevent, every round: tests/db/test_step_plans.py).
EVENTS_WAKE_SQL = f"""
WITH pending AS (
    SELECT e.id, e.task_id, e.name FROM tasks_taskevent AS e
    WHERE NOT e.delivered
      AND (SELECT t.status FROM tasks_task AS t WHERE t.id = e.task_id) IS DISTINCT FROM 'RUNNING'
    ORDER BY e.id LIMIT %(limit)s
    FOR UPDATE OF e SKIP LOCKED
), held AS (
    SELECT t.id FROM tasks_task AS t
    WHERE t.id = ANY (ARRAY(SELECT task_id FROM pending)) AND t.status <> 'RUNNING'
    FOR UPDATE SKIP LOCKED
), woken AS (
    UPDATE tasks_task AS t SET run_after = statement_timestamp()
    FROM pending AS p
    WHERE t.id = ANY (ARRAY(SELECT id FROM held)) AND t.id = p.task_id AND t.status IN ('READY', 'BLOCKED')
      AND t.run_after > statement_timestamp() AND {_WAITS_FOR.format(name="p.name")}
    RETURNING t.id
)
UPDATE tasks_taskevent AS e SET delivered = true
FROM pending AS p
WHERE e.id = ANY (ARRAY(SELECT id FROM pending)) AND e.id = p.id
  AND (p.task_id = ANY (ARRAY(SELECT id FROM held))
       OR (SELECT 1 FROM tasks_task AS t WHERE t.id = p.task_id) IS NULL)
RETURNING e.task_id, e.task_id = ANY (ARRAY(SELECT id FROM woken))
"""

# -- child tasks (tasks/steps.py spawn, wait_for_task) -------------------------------------------------

# Inside a spawn's step, after the child's enqueue in the same transaction: the child bound to the
# task that spawned it (``awaited_by``), whose trigger (tasks_report_to_parent, migration 0041) stores
# the child's outcome as the parent's event ``task:<child id>`` when its status becomes final. An
# existing task an enqueue returned (its dedup or unique key) is bound too, unless it reports to
# another task already (no row back: refused); one that has ended already has its outcome stored here,
# as its trigger would have (delivered: the parent is running this step and reads it at its wait).
SPAWN_BIND_SQL = """
WITH bound AS (
    UPDATE tasks_task SET awaited_by = %(parent)s
    WHERE id = %(child)s AND (awaited_by IS NULL OR awaited_by = %(parent)s)
    RETURNING id, status, return_value, errors
), ended AS (
    INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)
    SELECT %(parent)s, 'task:' || b.id,
           jsonb_build_object('status', b.status, 'result', b.return_value, 'error', b.errors -> -1),
           clock_timestamp(), true
    FROM bound AS b WHERE b.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
    ON CONFLICT (task_id, name) DO NOTHING
)
SELECT id FROM bound
"""
