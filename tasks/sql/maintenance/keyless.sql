-- tasks.maintenance.keyless: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: ADOPT_KEYLESS_SQL
-- One batch of a queue's READY rows in claim order (priority DESC, run_after, id) after a position,
-- as two range scans of tasks_task_claim_idx: the rest of the position's level, then the levels
-- below it (an Append under a LIMIT: the second runs only when the first leaves room). A fresh pass
-- starts at priority 32767 (above every level: priorities are -100 to 100), so only the second scan
-- reads. The keyless rows among them are locked SKIP LOCKED (only those: a keyed row is never locked
-- here, so claims are not held up) and given the shared key "". Returns how many rows it read, how
-- many it adopted, and the last row read (the next position; none when it read nothing).
WITH scanned AS MATERIALIZED (
    (SELECT id, priority, run_after, fair_key FROM tasks_task
     WHERE status = 'READY' AND queue = %(queue)s AND priority = %(priority)s
       AND (run_after, id) > (%(run_after)s::timestamptz, %(id)s::bigint)
     ORDER BY run_after, id
     LIMIT %(batch)s)
    UNION ALL
    (SELECT id, priority, run_after, fair_key FROM tasks_task
     WHERE status = 'READY' AND queue = %(queue)s AND priority < %(priority)s
     ORDER BY priority DESC, run_after, id
     LIMIT %(batch)s)
    LIMIT %(batch)s
), adopted AS (
    UPDATE tasks_task AS t SET fair_key = ''
    WHERE t.id = ANY(ARRAY(
        SELECT k.id FROM tasks_task AS k
        WHERE k.id = ANY(ARRAY(SELECT s.id FROM scanned AS s WHERE s.fair_key IS NULL))
          AND k.status = 'READY' AND k.fair_key IS NULL
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING t.id
)
SELECT (SELECT count(*) FROM scanned), (SELECT count(*) FROM adopted), last.priority, last.run_after, last.id
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT s.priority, s.run_after, s.id FROM scanned AS s
    ORDER BY s.priority, s.run_after DESC, s.id DESC
    LIMIT 1
) AS last ON true;

-- name: ADOPT_NEW_KEYLESS_SQL
-- The rows inserted since the last round (the primary key after ``after``, at most ``batch`` of them,
-- whatever their queue): a replica on older code keeps inserting keyless rows during a rolling
-- deploy, at the end of their level, where the pass above reaches them last. Those of the fair
-- queues that are READY and keyless are adopted as above. Returns rows read, rows adopted and the
-- last id read (NULL: none, the position stays). An id committed after a larger one was read (its
-- transaction was slower) is left to the pass.
WITH scanned AS MATERIALIZED (
    SELECT id, queue, status, fair_key FROM tasks_task
    WHERE id > %(after)s
    ORDER BY id
    LIMIT %(batch)s
), adopted AS (
    UPDATE tasks_task AS t SET fair_key = ''
    WHERE t.id = ANY(ARRAY(
        SELECT k.id FROM tasks_task AS k
        WHERE k.id = ANY(ARRAY(
            SELECT s.id FROM scanned AS s
            WHERE s.fair_key IS NULL AND s.status = 'READY' AND s.queue = ANY(%(queues)s::text[])
        ))
          AND k.status = 'READY' AND k.fair_key IS NULL AND k.queue = ANY(%(queues)s::text[])
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING t.id
)
SELECT (SELECT count(*) FROM scanned), (SELECT count(*) FROM adopted), (SELECT max(id) FROM scanned);
