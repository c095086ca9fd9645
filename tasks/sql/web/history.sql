-- tasks.web.history: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: HOURS_SQL
-- One row per hour of the window, oldest first, zeros included: its sums over the keys asked for,
-- and whether the rollup has counted it (its mark; the newest hour is counted a few minutes after
-- it ends).
WITH span AS (
    SELECT generate_series(
        date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s),
        date_trunc('hour', statement_timestamp()) - interval '1 hour',
        interval '1 hour') AS hour
), summed AS (
    SELECT hour, sum(succeeded), sum(failed), sum(cancelled), sum(attempt_failures), sum(timed),
       sum(wait_sum), max(wait_max), sum(run_sum), max(run_max),
       ARRAY[sum(wait_buckets[1]), sum(wait_buckets[2]), sum(wait_buckets[3]), sum(wait_buckets[4]), sum(wait_buckets[5]), sum(wait_buckets[6]), sum(wait_buckets[7]), sum(wait_buckets[8]), sum(wait_buckets[9]), sum(wait_buckets[10]), sum(wait_buckets[11]), sum(wait_buckets[12]), sum(wait_buckets[13]), sum(wait_buckets[14]), sum(wait_buckets[15]), sum(wait_buckets[16]), sum(wait_buckets[17]), sum(wait_buckets[18]), sum(wait_buckets[19]), sum(wait_buckets[20]), sum(wait_buckets[21]), sum(wait_buckets[22]), sum(wait_buckets[23])]::bigint[], ARRAY[sum(run_buckets[1]), sum(run_buckets[2]), sum(run_buckets[3]), sum(run_buckets[4]), sum(run_buckets[5]), sum(run_buckets[6]), sum(run_buckets[7]), sum(run_buckets[8]), sum(run_buckets[9]), sum(run_buckets[10]), sum(run_buckets[11]), sum(run_buckets[12]), sum(run_buckets[13]), sum(run_buckets[14]), sum(run_buckets[15]), sum(run_buckets[16]), sum(run_buckets[17]), sum(run_buckets[18]), sum(run_buckets[19]), sum(run_buckets[20]), sum(run_buckets[21]), sum(run_buckets[22]), sum(run_buckets[23])]::bigint[]
    FROM tasks_activityhour
    WHERE hour >= date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s)
      AND hour < date_trunc('hour', statement_timestamp())
      AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR task_path = %(task_path)s::text)
    GROUP BY hour
)
SELECT span.hour, mark.hour IS NOT NULL, summed.*
FROM span
LEFT JOIN summed ON summed.hour = span.hour
LEFT JOIN tasks_activityhourmark AS mark ON mark.hour = span.hour
ORDER BY span.hour;

-- name: KEYS_SQL
-- The busiest keys of the window with their sums (for their own percentiles).
SELECT queue, task_path, sum(succeeded), sum(failed), sum(cancelled), sum(attempt_failures), sum(timed),
       sum(wait_sum), max(wait_max), sum(run_sum), max(run_max),
       ARRAY[sum(wait_buckets[1]), sum(wait_buckets[2]), sum(wait_buckets[3]), sum(wait_buckets[4]), sum(wait_buckets[5]), sum(wait_buckets[6]), sum(wait_buckets[7]), sum(wait_buckets[8]), sum(wait_buckets[9]), sum(wait_buckets[10]), sum(wait_buckets[11]), sum(wait_buckets[12]), sum(wait_buckets[13]), sum(wait_buckets[14]), sum(wait_buckets[15]), sum(wait_buckets[16]), sum(wait_buckets[17]), sum(wait_buckets[18]), sum(wait_buckets[19]), sum(wait_buckets[20]), sum(wait_buckets[21]), sum(wait_buckets[22]), sum(wait_buckets[23])]::bigint[], ARRAY[sum(run_buckets[1]), sum(run_buckets[2]), sum(run_buckets[3]), sum(run_buckets[4]), sum(run_buckets[5]), sum(run_buckets[6]), sum(run_buckets[7]), sum(run_buckets[8]), sum(run_buckets[9]), sum(run_buckets[10]), sum(run_buckets[11]), sum(run_buckets[12]), sum(run_buckets[13]), sum(run_buckets[14]), sum(run_buckets[15]), sum(run_buckets[16]), sum(run_buckets[17]), sum(run_buckets[18]), sum(run_buckets[19]), sum(run_buckets[20]), sum(run_buckets[21]), sum(run_buckets[22]), sum(run_buckets[23])]::bigint[]
FROM tasks_activityhour
WHERE hour >= date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s)
      AND hour < date_trunc('hour', statement_timestamp())
      AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR task_path = %(task_path)s::text)
GROUP BY queue, task_path
ORDER BY sum(succeeded) + sum(failed) + sum(cancelled) DESC, queue, task_path
LIMIT %(limit)s;

-- name: OPTIONS_SQL
-- What the filters offer: the queues and task paths seen in the window.
SELECT DISTINCT queue, task_path
FROM tasks_activityhour
WHERE hour >= date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s)
  AND hour < date_trunc('hour', statement_timestamp())
LIMIT %(limit)s;
