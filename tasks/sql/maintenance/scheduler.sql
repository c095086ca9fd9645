-- tasks.maintenance.scheduler: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: SLOT_SQL
-- One slot, one statement: allocate the task's id, advance the schedule row (fenced, forward
-- only), record the run (unique per schedule + slot: DO NOTHING on a duplicate, and then no task),
-- insert the task. Each step reads the one before it, so nothing is written unless the lease and
-- the fence allow it, and no task is inserted for a slot that already has a run. It answers no row
-- when refused, and a NULL task when the slot had a run already. The task columns are listed here
-- (not shared with ENQUEUE_SQL): a column added to tasks_task needs a database default, or an
-- entry here.
WITH lease AS (
    SELECT token FROM leasing_lease
    WHERE resource = %(lease)s AND holder = %(holder)s AND token = %(token)s
      AND released_at IS NULL AND expires_at > clock_timestamp()
    FOR SHARE
),
current AS (
    SELECT name FROM tasks_storedschedule
    WHERE name = %(name)s AND revision = %(revision)s AND created_at = %(stored_at)s AND NOT paused
    FOR SHARE
),
allocated AS (
    SELECT nextval(pg_get_serial_sequence('tasks_task', 'id')) AS task_id FROM lease
),
advanced AS (
    UPDATE tasks_schedule AS s SET
        last_slot = %(slot)s, last_enqueued_slot = %(slot)s, last_enqueued_at = clock_timestamp(),
        last_task_id = allocated.task_id, next_slot = %(next_slot)s, enqueued = s.enqueued + 1,
        skipped = s.skipped + %(skipped)s, fence_token = %(token)s, leader = %(holder)s,
        updated_at = clock_timestamp()
    FROM allocated
    WHERE s.name = %(name)s AND s.fence_token <= %(token)s
      AND (s.last_slot IS NULL OR s.last_slot < %(slot)s)
      AND (%(revision)s::bigint IS NULL OR EXISTS (SELECT FROM current))
    RETURNING allocated.task_id
),
run AS (
    INSERT INTO tasks_schedulerun (schedule, slot, task_id, token, enqueued_at)
    SELECT %(name)s, %(slot)s, task_id, %(token)s, clock_timestamp() FROM advanced
    ON CONFLICT (schedule, slot) DO NOTHING
    RETURNING task_id
),
task AS (
    INSERT INTO tasks_task (
        id, queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts, max_attempts,
        timeout, dedup_key, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
        unstarted_returns, attempt_started, attempt_isolated, errors_dropped, fair_key, api_origin)
    SELECT run.task_id, %(queue)s, %(priority)s, %(task_path)s, %(args)s::jsonb, %(kwargs)s::jsonb, 'READY',
           statement_timestamp(), statement_timestamp(), 0, %(max_attempts)s, %(timeout)s, NULL, '[]'::jsonb,
           '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false, 0, %(fair_key)s::text, %(api_origin)s
    FROM run
    RETURNING id
)
SELECT advanced.task_id, (SELECT id FROM task) FROM advanced;

-- name: SKIP_SQL
-- Slots passed over without a task (catch-up "skip" / "last"): the same fenced, forward-only step.
WITH lease AS (
    SELECT token FROM leasing_lease
    WHERE resource = %(lease)s AND holder = %(holder)s AND token = %(token)s
      AND released_at IS NULL AND expires_at > clock_timestamp()
    FOR SHARE
),
current AS (
    SELECT name FROM tasks_storedschedule
    WHERE name = %(name)s AND revision = %(revision)s AND created_at = %(stored_at)s AND NOT paused
    FOR SHARE
)
UPDATE tasks_schedule AS s SET
    last_slot = %(slot)s, next_slot = %(next_slot)s, skipped = s.skipped + %(skipped)s,
    fence_token = %(token)s, leader = %(holder)s, updated_at = clock_timestamp()
FROM lease
WHERE s.name = %(name)s AND s.fence_token <= %(token)s
      AND (s.last_slot IS NULL OR s.last_slot < %(slot)s)
      AND (%(revision)s::bigint IS NULL OR EXISTS (SELECT FROM current))
RETURNING s.name;

-- name: SYNC_SQL
-- A new term: every declared schedule gets its row (baseline: now, so a new schedule's first slot
-- is the first one after it was first seen) and the leader's definition and token. Stamping the
-- token at once makes every later write of a deposed leader fail the fence.
WITH lease AS (
    SELECT token FROM leasing_lease
    WHERE resource = %(lease)s AND holder = %(holder)s AND token = %(token)s
      AND released_at IS NULL AND expires_at > clock_timestamp()
    FOR SHARE
)
INSERT INTO tasks_schedule AS s (name, definition, baseline_at, next_slot, enqueued, skipped, fence_token, leader,
                                 updated_at)
SELECT %(name)s, %(definition)s::jsonb, clock_timestamp(), %(next_slot)s, 0, 0, %(token)s, %(holder)s,
       clock_timestamp()
FROM lease
ON CONFLICT (name) DO UPDATE SET
    definition = EXCLUDED.definition, next_slot = COALESCE(EXCLUDED.next_slot, s.next_slot),
    fence_token = EXCLUDED.fence_token, leader = EXCLUDED.leader, updated_at = EXCLUDED.updated_at
WHERE s.fence_token <= EXCLUDED.fence_token
RETURNING s.name, s.baseline_at, s.last_slot;
