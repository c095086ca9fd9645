-- tasks.lifecycle.workflows: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: RESERVE_IDS_SQL
-- : The ids a workflow's members will have, drawn before they are inserted (so that the edges can be
-- : written in the same round of statements, and the callers know which id is which step).
SELECT nextval(pg_get_serial_sequence('tasks_task', 'id')) FROM generate_series(1, %(n)s::int);

-- name: CREATE_WORKFLOW_SQL
-- The workflow's row, RUNNING, with every member counted as remaining; its callback (if any) waits
-- for callback_waiting members. The members and edges follow in the same transaction.
INSERT INTO tasks_workflow (name, kind, status, total, remaining, failed, callback_id, callback_waiting, callback_only,
                            created_at)
VALUES (%(name)s::text, %(kind)s::text, 'RUNNING', %(total)s::int, %(total)s::int, 0, %(callback)s::bigint,
        %(callback_waiting)s::int, %(callback_only)s::boolean, statement_timestamp())
RETURNING id, created_at;

-- name: INSERT_MEMBERS_SQL
-- Every member in one statement (a group of 10,000 is one insert). What members share (queue,
-- priority, path, options: a group's members share all of it) is sent once per distinct set, as
-- arrays ("templates"); what each has of its own is one JSON document: [template, waiting_on, args,
-- kwargs] per member, encoded by Python's C encoder in one call and parsed by the server, where
-- 12 arrays of 10,000 elements were each dumped element by element in Python. AWAITING rows are
-- invisible to the claim (they are not in its index); a keyed READY row becomes BLOCKED in its
-- insert trigger, as for any enqueue. A waiting_on of -1 is a group's callback: AWAITING with
-- waiting_on 0, counted down on its workflow row (remaining), not on its own.
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
ORDER BY m.n;

-- name: INSERT_EDGES_SQL
-- Every edge in one statement: one JSON document, [child id, on_failure, pipe, [parent ids]] per child.
INSERT INTO tasks_taskdependency (parent_id, child_id, on_failure, pipe)
SELECT p.value::bigint, (e.item ->> 0)::bigint, e.item ->> 1, (e.item ->> 2)::boolean
FROM jsonb_array_elements(%(edges)s::jsonb) AS e(item), jsonb_array_elements_text(e.item -> 3) AS p(value);

-- name: LOCK_PARENTS_SQL
-- An enqueue that names existing tasks as parents: they are locked (in id order) until the enqueue
-- commits, so a parent cannot finish unseen between this look and the dependant's insert (its
-- finishing statement waits for the lock and then sees the new edge).
SELECT id, status, workflow_id FROM tasks_task WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR NO KEY UPDATE;

-- name: PARENT_VALUES_SQL
-- What the parents returned, in id order: a dependant's inputs when it is enqueued with its values.
SELECT return_value FROM tasks_task WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id;

-- name: CANCEL_AT_ONCE_SQL
-- A dependant enqueued after a parent already failed, under on_failure = 'cancel': cancelled at once,
-- by an update, so that the workflow trigger counts it like any member.
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
WHERE c.id = %(id)s AND c.status = 'AWAITING';

-- name: ADOPT_SQL
-- Parents enqueued without a workflow join the dependant's new one, counted as they stand.
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
WHERE w.id = %(workflow)s::bigint;

-- name: JOIN_WORKFLOW_SQL
-- One more member in an existing workflow (a dependant enqueued later): it is open again until the
-- new member is final, and a group's members may now have a dependant besides its callback.
UPDATE tasks_workflow SET
    callback_only = false,
    total = total + 1,
    remaining = remaining + 1,
    status = CASE WHEN status <> 'CANCELLED' THEN 'RUNNING' ELSE status END,
    finished_at = NULL
WHERE id = %(workflow)s::bigint;

-- name: MARK_CANCELLED_SQL
-- An operator's cancel of a workflow, once its unfinished members are cancelled (they ended it, FAILED
-- with their cancellations counted): it is CANCELLED.
UPDATE tasks_workflow SET status = 'CANCELLED' WHERE id = ANY(%(ids)s::bigint[]) RETURNING id;

-- name: CALLBACK_WAITING_SQL
-- How many members a group's callback still waits for (Task.parents_left), from its workflow's row;
-- no row when the task is not that workflow's callback.
SELECT callback_waiting FROM tasks_workflow WHERE id = %(id)s AND callback_id = %(task)s;

-- name: PARENTS_SQL
-- The parents of a task, with what they returned: for a callback or a dependant reading its inputs
-- (a finish time of infinity or -infinity, a hand edit, as none: FiniteDateTimeField, tasks/models/task.py).
SELECT p.id, p.status, p.task_path, p.return_value, p.errors,
       CASE WHEN isfinite(p.finished_at) THEN p.finished_at END AS finished_at
FROM tasks_taskdependency AS d JOIN tasks_task AS p ON p.id = d.parent_id
WHERE d.child_id = %(id)s
ORDER BY p.id;

-- name: MEMBER_COUNTS_SQL
-- Members of one workflow per status (the workflow page and the API), through
-- tasks_task_workflow_idx (workflow_id, status).
SELECT status, count(*) FROM tasks_task WHERE workflow_id = %(id)s GROUP BY status;

-- name: PRUNE_WORKFLOWS_SQL
-- Retention: finished workflows of one status older than the age, a batch at a time, with their
-- members and edges (one statement: the unit goes at once or not at all). Locks are taken in the
-- order every finishing statement takes them: members first (in id order, SKIP LOCKED: a member an
-- operator is requeueing right now is passed over), then the workflows whose members are all held
-- and final (SKIP LOCKED too, status re-checked); the rest wait for the next pass. The members' steps
-- and events go with them (forget_steps_ctes).
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
), gone_steps AS (
    DELETE FROM tasks_taskstep AS s WHERE s.task_id = ANY(ARRAY(SELECT gone_members.id FROM gone_members))
), gone_events AS (
    DELETE FROM tasks_taskevent AS e WHERE e.task_id = ANY(ARRAY(SELECT gone_members.id FROM gone_members))
)
DELETE FROM tasks_workflow AS w USING picked
WHERE w.id = picked.id
RETURNING w.finished_at, w.id, (SELECT count(*) FROM gone_members);
