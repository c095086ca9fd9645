-- tasks.maintenance.retention: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: PRUNE_TASKS_SQL
-- Finished tasks of one status (and optionally one queue), through tasks_task_prune_idx
-- (status, finished_at, id) WHERE finished_at IS NOT NULL: an exact range scan of that status. Their
-- steps and events go in the same statement (forget_steps_ctes).
WITH picked AS MATERIALIZED (
    SELECT id FROM tasks_task AS candidate
    WHERE status = %(status)s AND finished_at IS NOT NULL AND workflow_id IS NULL
      AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
      AND finished_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (finished_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY finished_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM tasks_task AS doomed
    USING picked
    WHERE doomed.id = picked.id
    RETURNING doomed.finished_at, doomed.id
), gone_steps AS (
    DELETE FROM tasks_taskstep AS s WHERE s.task_id = ANY(ARRAY(SELECT deleted.id FROM deleted))
), gone_events AS (
    DELETE FROM tasks_taskevent AS e WHERE e.task_id = ANY(ARRAY(SELECT deleted.id FROM deleted))
)
SELECT finished_at, id FROM deleted;

-- name: PRUNE_LEASES_SQL
-- Leases that ended (released: expires_at was set to the release time; or expired) before the
-- cutoff, through leasing_lease_expires_idx. A live lease has expires_at in the future.
WITH picked AS MATERIALIZED (
    SELECT id FROM leasing_lease AS candidate
    WHERE true
      AND expires_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (expires_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY expires_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM leasing_lease AS doomed
USING picked
WHERE doomed.id = picked.id
RETURNING doomed.expires_at, doomed.id;

-- name: PRUNE_WORKERS_SQL
-- Workers that stopped (cleanly, or recorded dead by recovery) before the cutoff and hold no
-- running task, through tasks_worker_stopped_idx.
WITH picked AS MATERIALIZED (
    SELECT id FROM tasks_worker AS candidate
    WHERE stopped_at IS NOT NULL AND NOT EXISTS (SELECT 1 FROM tasks_task AS t WHERE t.status = 'RUNNING' AND t.holder = candidate.id)
      AND stopped_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (stopped_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY stopped_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM tasks_worker AS doomed
USING picked
WHERE doomed.id = picked.id
RETURNING doomed.stopped_at, doomed.id;

-- name: PRUNE_SCHEDULE_RUNS_SQL
-- Enqueued slots of periodic tasks (the schedule row keeps the newest), through
-- tasks_schedulerun_prune_idx (enqueued_at, id).
WITH picked AS MATERIALIZED (
    SELECT id FROM tasks_schedulerun AS candidate
    WHERE true
      AND enqueued_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (enqueued_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY enqueued_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM tasks_schedulerun AS doomed
USING picked
WHERE doomed.id = picked.id
RETURNING doomed.enqueued_at, doomed.id;

-- name: PRUNE_UNIQUE_KEYS_SQL
-- Windows of unique keys (tasks/lifecycle/windows.py) that passed before the cutoff, through
-- tasks_uniquekey_expires_idx (expires_at, key). An open window has expires_at in the future, and a
-- window reopened meanwhile has it on its newest version, which the row lock re-checks.
WITH picked AS MATERIALIZED (
    SELECT key FROM tasks_uniquekey
    WHERE expires_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (expires_at, key) > (%(after_at)s, %(after_id)s::text)
    ORDER BY expires_at, key
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM tasks_uniquekey AS doomed
USING picked
WHERE doomed.key = picked.key
RETURNING doomed.expires_at, doomed.key;

-- name: PRUNE_BULK_OPERATIONS_SQL
-- Bulk operations that ended (done, cancelled or failed: each sets finished_at as it ends; an open one
-- has none) before the cutoff, through tasks_bulkop_finished_idx (finished_at, id). An operator reading
-- one as it goes is not in the way: a delete takes no lock a reader waits for.
WITH picked AS MATERIALIZED (
    SELECT id FROM tasks_bulkoperation AS candidate
    WHERE finished_at IS NOT NULL AND status IN ('DONE', 'CANCELLED', 'FAILED')
      AND finished_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (finished_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY finished_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM tasks_bulkoperation AS doomed
USING picked
WHERE doomed.id = picked.id
RETURNING doomed.finished_at, doomed.id;

-- name: ORPHANS_SQL['steps']
-- Steps and events whose task is in neither tasks_task nor tasks_finished: a batch of task ids after
-- the cursor, each probed by primary key in both tables (_orphans_sql), per statement.
WITH picked AS MATERIALIZED (
    SELECT DISTINCT o.task_id FROM tasks_taskstep AS o
    WHERE o.task_id > %(after)s
    ORDER BY o.task_id
    LIMIT %(limit)s
), kept AS MATERIALIZED (
    SELECT t.id FROM tasks_task AS t WHERE t.id = ANY(ARRAY(SELECT picked.task_id FROM picked))
    UNION ALL
    SELECT f.id FROM tasks_finished AS f WHERE f.id = ANY(ARRAY(SELECT picked.task_id FROM picked))
), orphaned AS MATERIALIZED (
    SELECT p.task_id FROM picked AS p WHERE NOT EXISTS (SELECT FROM kept WHERE kept.id = p.task_id)
), gone AS (
    DELETE FROM tasks_taskstep AS o WHERE o.task_id = ANY(ARRAY(SELECT orphaned.task_id FROM orphaned))
    RETURNING 1
)
SELECT (SELECT max(task_id) FROM picked), (SELECT count(*) FROM picked), (SELECT count(*) FROM gone);

-- name: ORPHANS_SQL['events']
-- Steps and events whose task is in neither tasks_task nor tasks_finished: a batch of task ids after
-- the cursor, each probed by primary key in both tables (_orphans_sql), per statement.
WITH picked AS MATERIALIZED (
    SELECT DISTINCT o.task_id FROM tasks_taskevent AS o
    WHERE o.task_id > %(after)s
    ORDER BY o.task_id
    LIMIT %(limit)s
), kept AS MATERIALIZED (
    SELECT t.id FROM tasks_task AS t WHERE t.id = ANY(ARRAY(SELECT picked.task_id FROM picked))
    UNION ALL
    SELECT f.id FROM tasks_finished AS f WHERE f.id = ANY(ARRAY(SELECT picked.task_id FROM picked))
), orphaned AS MATERIALIZED (
    SELECT p.task_id FROM picked AS p WHERE NOT EXISTS (SELECT FROM kept WHERE kept.id = p.task_id)
), gone AS (
    DELETE FROM tasks_taskevent AS o WHERE o.task_id = ANY(ARRAY(SELECT orphaned.task_id FROM orphaned))
    RETURNING 1
)
SELECT (SELECT max(task_id) FROM picked), (SELECT count(*) FROM picked), (SELECT count(*) FROM gone);
