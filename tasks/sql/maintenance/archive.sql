-- tasks.maintenance.archive: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: LIMITS_SQL
-- Where a pass may move up to: ARCHIVE_AFTER back from now, and no later than the oldest hour of the
-- history window not counted COUNTED_MARGIN ago (the open hour at the latest): from then on a count of
-- that hour stands (history.py, COUNT_HOUR_SQL), so moving its tasks cannot take them out of it. One
-- statement: the clock read once, HISTORY_HOURS primary-key probes of the marks at most.
SELECT statement_timestamp(),
       LEAST(statement_timestamp() - make_interval(secs => %(after)s),
             (SELECT min(h.hour)
              FROM generate_series(date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s),
                                   date_trunc('hour', statement_timestamp()), interval '1 hour') AS h(hour)
              WHERE NOT EXISTS (SELECT 1 FROM tasks_activityhourmark AS m WHERE m.hour = h.hour
                                AND m.counted_at < statement_timestamp() - make_interval(secs => %(margin)s))));

-- name: NEXT_SQL
-- The next task a batch would move (its finish time says which day's partition the batch needs).
SELECT finished_at FROM tasks_task
WHERE status = %(status)s AND finished_at IS NOT NULL AND workflow_id IS NULL
  AND finished_at >= %(since)s::timestamptz AND finished_at < %(until)s::timestamptz
  AND (finished_at, id) > (%(after_at)s, %(after_id)s)
ORDER BY finished_at, id
LIMIT 1;

-- name: PROGRESS_SQL
-- A pass's end: the mark moved up to its limit (never back), with no rows counted.
INSERT INTO tasks_archiveprogress (status, moved_until, recorded_at, moved)
VALUES (%(status)s, %(until)s, statement_timestamp(), 0)
ON CONFLICT (status) DO UPDATE
    SET moved_until = GREATEST(tasks_archiveprogress.moved_until, EXCLUDED.moved_until),
        recorded_at = EXCLUDED.recorded_at, moved = tasks_archiveprogress.moved + EXCLUDED.moved;

-- name: ARCHIVE_SQL
-- One batch: picked as retention picks (MATERIALIZED: the pick runs once, tasks/lifecycle/claim.py
-- says why), deleted, inserted, its progress noted; returns the keys moved. ``until`` ends the batch
-- at its day's end.
WITH picked AS MATERIALIZED (
    SELECT id FROM tasks_task AS candidate
    WHERE status = %(status)s AND finished_at IS NOT NULL AND workflow_id IS NULL
      AND finished_at >= %(since)s::timestamptz AND finished_at < %(until)s::timestamptz
      AND (finished_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY finished_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM tasks_task AS t USING picked WHERE t.id = picked.id RETURNING t.*
), kept AS (
    INSERT INTO tasks_finished SELECT * FROM moved
    RETURNING finished_at, id
), progress AS (
    INSERT INTO tasks_archiveprogress (status, moved_until, recorded_at, moved)
    SELECT %(status)s, max(finished_at), statement_timestamp(), count(*) FROM kept HAVING count(*) > 0
    ON CONFLICT (status) DO UPDATE
    SET moved_until = GREATEST(tasks_archiveprogress.moved_until, EXCLUDED.moved_until),
        recorded_at = EXCLUDED.recorded_at, moved = tasks_archiveprogress.moved + EXCLUDED.moved
)
SELECT finished_at, id FROM kept;
