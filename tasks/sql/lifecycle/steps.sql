-- tasks.lifecycle.steps: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: STEPS_READ_SQL
-- The stored steps of a task, in the order they ran: read once by each attempt, at its first step.
SELECT position, name, result::text, attempt FROM tasks_taskstep WHERE task_id = %(id)s ORDER BY position;

-- name: STEP_RECORD_SQL
-- The fence: a step's result, stored only while the attempt holds the task; the row's share lock is
-- held to the commit of the step's transaction. No row back: the attempt no longer holds the task and
-- the step's transaction must roll back.
INSERT INTO tasks_taskstep (task_id, position, name, attempt, token, result, started_at, completed_at)
SELECT t.id, %(position)s, %(name)s, %(attempt)s, t.token, %(result)s::jsonb, %(started_at)s, clock_timestamp()
FROM (
    SELECT id, token FROM tasks_task
    WHERE id = %(id)s AND holder = %(worker)s AND token = %(token)s AND status = 'RUNNING'
      AND expires_at > clock_timestamp()
    FOR SHARE
) AS t
RETURNING position;

-- name: SLEEP_WAKE_SQL
-- A durable sleep's wake time: the database clock plus the sleep (stored as the sleep's step).
SELECT clock_timestamp() + make_interval(secs => %(seconds)s);

-- name: SLEEP_REMAINING_SQL
-- The seconds left until a durable sleep's stored wake time, on the database clock (not above zero:
-- it has passed).
SELECT EXTRACT(EPOCH FROM (%(wake)s::timestamptz - clock_timestamp()))::float8;

-- name: EVENT_LOCK_SQL
-- The send, first: the task's row under a share lock, so that a cancel or finish in flight commits
-- before the send reads it (``EVENT_SEND_SQL`` runs next, in the same transaction, on a new snapshot).
SELECT status FROM tasks_task WHERE id = %(id)s FOR SHARE;

-- name: EVENT_SEND_SQL
-- The send, to the tasks ``ids`` (one for send_event, a workflow's unfinished members for
-- send_workflow_event): each waiting for this event in the queue made due, unless one of the name was
-- sent to it before, and the event stored for each unfinished one in tasks_task. Returns the ids it
-- was stored for; an id left out is finished, moved, absent, or had one of the name.
WITH woken AS (
    UPDATE tasks_task AS t SET run_after = LEAST(t.run_after, statement_timestamp())
    WHERE t.id = ANY (%(ids)s::bigint[]) AND t.status IN ('READY', 'BLOCKED')
      AND EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'wait:' || %(name)s)
      AND NOT EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'event:' || %(name)s)
      AND NOT EXISTS (SELECT FROM tasks_taskevent AS e WHERE e.task_id = t.id AND e.name = %(name)s)
    RETURNING t.id
)
INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)
SELECT t.id, %(name)s, %(payload)s::jsonb, clock_timestamp(), t.id IN (SELECT id FROM woken)
FROM tasks_task AS t
WHERE t.id = ANY (%(ids)s::bigint[]) AND t.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
ORDER BY t.id
ON CONFLICT (task_id, name) DO NOTHING
RETURNING task_id;

-- name: WORKFLOW_EVENT_LOCK_SQL
-- An event to every unfinished member of a workflow (tasks/steps.py send_workflow_event): the members
-- under a share lock, in id order (the order a workflow's cancel and every finish lock them: no
-- deadlock with either), so that a cancel or finish in flight commits first; then EVENT_SEND_SQL
-- for all of them in one statement, on a new snapshot.
SELECT id FROM tasks_task
WHERE workflow_id = %(workflow)s AND status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
ORDER BY id
FOR SHARE;

-- name: EVENT_CHECK_SQL
-- A wait's look: the event's payload if one was sent by its deadline (found), and the seconds left
-- to the deadline on the database clock (NULL: it waits without one).
SELECT e.payload::text, e.id IS NOT NULL, EXTRACT(EPOCH FROM (%(deadline)s::timestamptz - clock_timestamp()))::float8
FROM (SELECT 1) AS one
LEFT JOIN tasks_taskevent AS e ON e.task_id = %(id)s AND e.name = %(name)s
    AND e.sent_at <= COALESCE(%(deadline)s::timestamptz, 'infinity');

-- name: EVENTS_WAKE_SQL
-- The recovery round: the undelivered events of tasks not RUNNING (rows no other session holds, and
-- tasks no other session holds: a held one is left for a later round). A task suspended on the wait
-- for one is made due; every one looked at is delivered (a task that waits for something else reads
-- its events when it reaches their wait; a finished or moved task never will). Each read is by key:
-- the undelivered events' partial index in id order, each task's status probed by its primary key,
-- the batch's tasks and events by ``= ANY`` of their ids (joins here were planned as sequential scans
-- of tasks_task and tasks_taskevent, every round: tests/db/test_step_plans.py).
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
      AND t.run_after > statement_timestamp() AND EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'wait:' || p.name)
      AND NOT EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'event:' || p.name)
    RETURNING t.id
)
UPDATE tasks_taskevent AS e SET delivered = true
FROM pending AS p
WHERE e.id = ANY (ARRAY(SELECT id FROM pending)) AND e.id = p.id
  AND (p.task_id = ANY (ARRAY(SELECT id FROM held))
       OR (SELECT 1 FROM tasks_task AS t WHERE t.id = p.task_id) IS NULL)
RETURNING e.task_id, e.task_id = ANY (ARRAY(SELECT id FROM woken));

-- name: SPAWN_BIND_SQL
-- Inside a spawn's step, after the child's enqueue in the same transaction: the child bound to the
-- task that spawned it (``awaited_by``), whose trigger (tasks_report_to_parent, migration 0041) stores
-- the child's outcome as the parent's event ``task:<child id>`` when its status becomes final. An
-- existing task an enqueue returned (its dedup or unique key) is bound too, unless it reports to
-- another task already (no row back: refused); one that has ended already has its outcome stored here,
-- as its trigger would have (delivered: the parent is running this step and reads it at its wait).
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
SELECT id FROM bound;
