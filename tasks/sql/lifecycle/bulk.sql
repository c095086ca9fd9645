-- tasks.lifecycle.bulk: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: BULK_RETRY_SQL
-- : One batch of a bulk operation of each kind (see :func:`_bulk_sql`).
WITH op AS MATERIALIZED (
    SELECT b.id, b.cursor, b.last_id FROM tasks_bulkoperation AS b
    WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
    FOR UPDATE
),
window_end AS MATERIALIZED (
    SELECT LEAST(op.last_id, COALESCE(LEAST((SELECT min(n.id) FROM tasks_task AS n WHERE n.id > op.cursor), (SELECT min(f.id) FROM tasks_finished AS f WHERE f.id > op.cursor)), op.last_id) + %(span)s - 1) AS hi
    FROM op
),
picked AS MATERIALIZED (
    SELECT id, moved FROM (
    (SELECT t.id, false AS moved FROM tasks_task AS t, op, window_end AS w
    WHERE t.id > op.cursor AND t.id <= w.hi
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    ORDER BY t.id
    LIMIT %(batch)s)
    UNION ALL
    (SELECT t.id, true FROM tasks_finished AS t, op, window_end AS w
    WHERE t.id > op.cursor AND t.id <= w.hi
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    ORDER BY t.id
    LIMIT %(batch)s)
    ) AS both_tables
    ORDER BY id
    LIMIT %(batch)s
),
changed AS (
    UPDATE tasks_task AS t SET
    status = 'READY',
    run_after = clock_timestamp(),
    attempts = 0,
    failures = 0,
    crashes = 0,
    shared_crashes = 0,
    unstarted_returns = 0,
    attempt_started = false,
    finished_at = NULL,
    snoozed_at = NULL,
    trace_context = trace_context || '{"leasing-rerun": "1"}'::jsonb,
    fair_key = CASE WHEN fair_key IS NULL AND queue = ANY(%(fair_queues)s::text[]) THEN '' ELSE fair_key END
FROM picked, op
WHERE t.id = picked.id AND NOT picked.moved
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    RETURNING t.id
),
back AS (
    DELETE FROM tasks_finished AS f USING picked
    WHERE f.id = picked.id AND picked.moved
    RETURNING f.*
),
restored AS (
    INSERT INTO tasks_task SELECT * FROM back
    RETURNING id
),
counts AS MATERIALIZED (
    SELECT (SELECT count(*) FROM picked) AS picked,
           (SELECT count(*) FROM changed) + (SELECT count(*) FROM restored) AS changed,
           (SELECT max(id) FROM picked) AS last_picked
)
UPDATE tasks_bulkoperation AS b SET
    status = CASE WHEN (CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END) >= b.last_id
                  THEN 'DONE' ELSE 'RUNNING' END,
    cursor = CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END,
    matched = b.matched + c.picked,
    changed = b.changed + c.changed,
    skipped = b.skipped + c.picked - c.changed,
    batches = b.batches + 1,
    started_at = COALESCE(b.started_at, clock_timestamp()),
    updated_at = clock_timestamp(),
    finished_at = CASE WHEN (CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END) >= b.last_id
                       THEN clock_timestamp() END
FROM op, window_end AS w, counts AS c
WHERE b.id = op.id
RETURNING b.status, b.cursor, b.matched, b.changed, b.skipped, c.picked, c.changed, (SELECT array_agg(id ORDER BY id) FROM restored), (SELECT array_agg(p.id ORDER BY p.id) FROM picked AS p
    WHERE NOT p.moved AND NOT EXISTS (SELECT 1 FROM changed AS c WHERE c.id = p.id));

-- name: BULK_CANCEL_SQL
-- A cancel's batch: waiting tasks (never RUNNING) become CANCELLED.
WITH op AS MATERIALIZED (
    SELECT b.id, b.cursor, b.last_id FROM tasks_bulkoperation AS b
    WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
    FOR UPDATE
),
window_end AS MATERIALIZED (
    SELECT LEAST(op.last_id, COALESCE((SELECT min(n.id) FROM tasks_task AS n WHERE n.id > op.cursor), op.last_id) + %(span)s - 1) AS hi
    FROM op
),
picked AS MATERIALIZED (
    SELECT t.id, false AS moved FROM tasks_task AS t, op, window_end AS w
    WHERE t.id > op.cursor AND t.id <= w.hi
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    ORDER BY t.id
    LIMIT %(batch)s
),
changed AS (
    UPDATE tasks_task AS t SET
    status = 'CANCELLED',
    finished_at = clock_timestamp()
FROM picked, op
WHERE t.id = picked.id
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    RETURNING t.id
),
counts AS MATERIALIZED (
    SELECT (SELECT count(*) FROM picked) AS picked,
           (SELECT count(*) FROM changed) AS changed,
           (SELECT max(id) FROM picked) AS last_picked
)
UPDATE tasks_bulkoperation AS b SET
    status = CASE WHEN (CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END) >= b.last_id
                  THEN 'DONE' ELSE 'RUNNING' END,
    cursor = CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END,
    matched = b.matched + c.picked,
    changed = b.changed + c.changed,
    skipped = b.skipped + c.picked - c.changed,
    batches = b.batches + 1,
    started_at = COALESCE(b.started_at, clock_timestamp()),
    updated_at = clock_timestamp(),
    finished_at = CASE WHEN (CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END) >= b.last_id
                       THEN clock_timestamp() END
FROM op, window_end AS w, counts AS c
WHERE b.id = op.id
RETURNING b.status, b.cursor, b.matched, b.changed, b.skipped, c.picked, c.changed;

-- name: BULK_DISCARD_SQL
-- A discard's batch: waiting tasks fail for good (FAILED, with an error entry saying so).
WITH op AS MATERIALIZED (
    SELECT b.id, b.cursor, b.last_id FROM tasks_bulkoperation AS b
    WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
    FOR UPDATE
),
window_end AS MATERIALIZED (
    SELECT LEAST(op.last_id, COALESCE((SELECT min(n.id) FROM tasks_task AS n WHERE n.id > op.cursor), op.last_id) + %(span)s - 1) AS hi
    FROM op
),
picked AS MATERIALIZED (
    SELECT t.id, false AS moved FROM tasks_task AS t, op, window_end AS w
    WHERE t.id > op.cursor AND t.id <= w.hi
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    ORDER BY t.id
    LIMIT %(batch)s
),
changed AS (
    UPDATE tasks_task AS t SET
    status = 'FAILED',
    finished_at = clock_timestamp(),
    errors = CASE WHEN (jsonb_array_length(t.errors) >= 10) THEN (t.errors - 1) ELSE t.errors END || jsonb_build_array(jsonb_build_object(
            'type', 'tasks.Discarded', 'message', 'discarded by bulk operation ' || op.id,
            'traceback', '', 'kind', 'discard', 'at', clock_timestamp())),
    errors_dropped = t.errors_dropped + (jsonb_array_length(t.errors) >= 10)::int
FROM picked, op
WHERE t.id = picked.id
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    RETURNING t.id
),
counts AS MATERIALIZED (
    SELECT (SELECT count(*) FROM picked) AS picked,
           (SELECT count(*) FROM changed) AS changed,
           (SELECT max(id) FROM picked) AS last_picked
)
UPDATE tasks_bulkoperation AS b SET
    status = CASE WHEN (CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END) >= b.last_id
                  THEN 'DONE' ELSE 'RUNNING' END,
    cursor = CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END,
    matched = b.matched + c.picked,
    changed = b.changed + c.changed,
    skipped = b.skipped + c.picked - c.changed,
    batches = b.batches + 1,
    started_at = COALESCE(b.started_at, clock_timestamp()),
    updated_at = clock_timestamp(),
    finished_at = CASE WHEN (CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END) >= b.last_id
                       THEN clock_timestamp() END
FROM op, window_end AS w, counts AS c
WHERE b.id = op.id
RETURNING b.status, b.cursor, b.matched, b.changed, b.skipped, c.picked, c.changed;

-- name: BULK_SQL['retry']
-- Each kind's batch by its name, as the operation's row gives it (tasks/models/bulk.py).
-- (the same text as BULK_RETRY_SQL)

-- name: BULK_SQL['cancel']
-- Each kind's batch by its name, as the operation's row gives it (tasks/models/bulk.py).
-- (the same text as BULK_CANCEL_SQL)

-- name: BULK_SQL['discard']
-- Each kind's batch by its name, as the operation's row gives it (tasks/models/bulk.py).
-- (the same text as BULK_DISCARD_SQL)

-- name: BULK_RETRY_ONE_SQL
-- A retry of one row at a time, when a batch's retry collided with the unique dedup key of unfinished
-- tasks (tasks_task_dedup_unfinished: another task with the key is waiting or running, or two retried
-- rows share a key). The batch's statement rolled back whole; each row of it is tried alone under a
-- savepoint and a collision is counted as skipped. Same guard as the batch's.
WITH op AS MATERIALIZED (
    SELECT b.id FROM tasks_bulkoperation AS b
    WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
)
UPDATE tasks_task AS t SET
    status = 'READY',
    run_after = clock_timestamp(),
    attempts = 0,
    failures = 0,
    crashes = 0,
    shared_crashes = 0,
    unstarted_returns = 0,
    attempt_started = false,
    finished_at = NULL,
    snoozed_at = NULL,
    trace_context = trace_context || '{"leasing-rerun": "1"}'::jsonb,
    fair_key = CASE WHEN fair_key IS NULL AND queue = ANY(%(fair_queues)s::text[]) THEN '' ELSE fair_key END
FROM op
WHERE t.id = %(task)s
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
RETURNING t.id;

-- name: BULK_PICK_SQL
-- The ids a retry's batch would pick, without changing anything (the one-row fallback's list): id,
-- the window's end, and whether the row is in tasks_finished.
WITH op AS MATERIALIZED (
    SELECT b.id, b.cursor, b.last_id FROM tasks_bulkoperation AS b
    WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
    FOR UPDATE
),
window_end AS MATERIALIZED (
    SELECT LEAST(op.last_id, COALESCE(LEAST((SELECT min(n.id) FROM tasks_task AS n WHERE n.id > op.cursor), (SELECT min(f.id) FROM tasks_finished AS f WHERE f.id > op.cursor)), op.last_id) + %(span)s - 1) AS hi
    FROM op
),
picked AS MATERIALIZED (
    SELECT id, moved FROM (
    (SELECT t.id, false AS moved FROM tasks_task AS t, op, window_end AS w
    WHERE t.id > op.cursor AND t.id <= w.hi
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    ORDER BY t.id
    LIMIT %(batch)s)
    UNION ALL
    (SELECT t.id, true FROM tasks_finished AS t, op, window_end AS w
    WHERE t.id > op.cursor AND t.id <= w.hi
      AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    ORDER BY t.id
    LIMIT %(batch)s)
    ) AS both_tables
    ORDER BY id
    LIMIT %(batch)s
)
SELECT p.id, w.hi, p.moved FROM picked AS p, window_end AS w
ORDER BY p.id;

-- name: RETRY_RESTORED_SQL
-- The requeue of the rows a retry's batch brought back from tasks_finished (RERUN_SET, as a retry of a
-- row of tasks_task writes), in the batch's transaction: a dedup key another unfinished task holds
-- fails it, and the batch is redone a row at a time.
UPDATE tasks_task AS t SET
    status = 'READY',
    run_after = clock_timestamp(),
    attempts = 0,
    failures = 0,
    crashes = 0,
    shared_crashes = 0,
    unstarted_returns = 0,
    attempt_started = false,
    finished_at = NULL,
    snoozed_at = NULL,
    trace_context = trace_context || '{"leasing-rerun": "1"}'::jsonb,
    fair_key = CASE WHEN fair_key IS NULL AND queue = ANY(%(fair_queues)s::text[]) THEN '' ELSE fair_key END
WHERE t.id = ANY(%(ids)s::bigint[])
RETURNING t.id;

-- name: RETRY_MISSED_SQL
-- A retry's rows the batch picked in tasks_task but found gone when it came to change them: the mover
-- took them to tasks_finished after the batch's snapshot (its delete committed while the batch waited
-- for the row). In the batch's transaction, after its statement (a new snapshot, in which the move is
-- seen), those of them in tasks_finished that still match come back unchanged (this statement), are
-- requeued (RETRY_RESTORED_SQL: a statement of its own, which sees the rows this one inserts) and
-- counted changed, not skipped (MISSED_COUNTED_SQL). A row gone for another reason (deleted, rerun by
-- someone else) is not in tasks_finished: it stays skipped.
WITH back AS (
    DELETE FROM tasks_finished AS t
    WHERE t.id = ANY(%(ids)s::bigint[]) AND t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)
    RETURNING t.*
)
INSERT INTO tasks_task SELECT * FROM back
RETURNING id;

-- name: MISSED_COUNTED_SQL
-- Rows a retry batch picked in tasks_task but found taken by the mover meanwhile, brought back from
-- tasks_finished and run again: counted changed, not skipped, on the operation's row.
UPDATE tasks_bulkoperation AS b SET
    changed = b.changed + %(found)s,
    skipped = b.skipped - %(found)s
WHERE b.id = %(operation)s
RETURNING b.status, b.cursor, b.matched, b.changed, b.skipped;

-- name: BULK_ADVANCE_SQL
-- Progress of a batch done one row at a time (the fallback above), in the same transaction.
UPDATE tasks_bulkoperation AS b SET
    status = CASE WHEN %(cursor)s >= b.last_id THEN 'DONE' ELSE 'RUNNING' END,
    cursor = %(cursor)s,
    matched = b.matched + %(picked)s,
    changed = b.changed + %(changed)s,
    skipped = b.skipped + %(picked)s - %(changed)s,
    batches = b.batches + 1,
    started_at = COALESCE(b.started_at, clock_timestamp()),
    updated_at = clock_timestamp(),
    finished_at = CASE WHEN %(cursor)s >= b.last_id THEN clock_timestamp() END
WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
RETURNING b.status, b.cursor, b.matched, b.changed, b.skipped;

-- name: BULK_FAIL_SQL
-- An operation whose statement the database refuses for good (a value out of range in a filter written
-- around the validation, say) ends FAILED with the reason, instead of holding up the operations after it.
UPDATE tasks_bulkoperation SET status = 'FAILED', error = %(error)s, finished_at = clock_timestamp(),
    updated_at = clock_timestamp()
WHERE id = %(operation)s AND status IN ('PENDING', 'RUNNING');
