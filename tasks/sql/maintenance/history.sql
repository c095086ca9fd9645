-- tasks.maintenance.history: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: COUNT_HOUR_SQL
-- Count one hour and store it: every (queue, task path) that finished in it, overwritten whole, and
-- the hour's mark, in one statement (one transaction: all or nothing). The finished CTE is the range
-- [hour, hour + 1 h) of each final status in tasks_task_prune_idx (status, finished_at, id); the times
-- use the database's own timestamps.
WITH settled AS MATERIALIZED (
    -- An hour counted COUNTED_MARGIN ago or more stands: a count begun since (a deposed leader's, a
    -- cron run's, from a list of due hours read before the mark) changes nothing. Its tasks may have
    -- left tasks_task meanwhile (the mover, tasks/maintenance/archive.py, waits that long).
    SELECT 1 FROM tasks_activityhourmark
    WHERE hour = %(hour)s::timestamptz AND counted_at < statement_timestamp() - make_interval(secs => %(margin)s)
), finished AS MATERIALIZED (
    SELECT queue, task_path, status, failures, timed.wait, timed.run,
           width_bucket(timed.wait, ARRAY[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0]::float8[]) AS wait_bucket,
           width_bucket(timed.run, ARRAY[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0]::float8[]) AS run_bucket
    FROM tasks_task
    CROSS JOIN LATERAL (
        -- Timed: a task whose last attempt ran. ``attempts`` > 0 as well as ``last_attempted_at``: a
        -- retry (bulk or an operator's) starts the count again but keeps the old attempt's time, and a
        -- task discarded before it ran again was timed with it (a 48-hour "run").
        SELECT CASE WHEN status IN ('SUCCESSFUL', 'FAILED') AND last_attempted_at IS NOT NULL AND attempts > 0
                    THEN GREATEST(EXTRACT(EPOCH FROM last_attempted_at - run_after)::float8, 0) END AS wait,
               CASE WHEN status IN ('SUCCESSFUL', 'FAILED') AND last_attempted_at IS NOT NULL AND attempts > 0
                    THEN GREATEST(EXTRACT(EPOCH FROM finished_at - last_attempted_at)::float8, 0) END AS run
    ) AS timed
    WHERE status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
      AND finished_at >= %(hour)s::timestamptz AND finished_at < %(hour)s::timestamptz + interval '1 hour'
      AND NOT EXISTS (SELECT 1 FROM settled)
), keyed AS (
    SELECT queue, task_path,
           count(*) FILTER (WHERE status = 'SUCCESSFUL') AS succeeded,
           count(*) FILTER (WHERE status = 'FAILED') AS failed,
           count(*) FILTER (WHERE status = 'CANCELLED') AS cancelled,
           COALESCE(sum(failures), 0) AS attempt_failures,
           count(wait) AS timed,
           COALESCE(sum(wait), 0) AS wait_sum, COALESCE(max(wait), 0) AS wait_max,
           COALESCE(sum(run), 0) AS run_sum, COALESCE(max(run), 0) AS run_max,
           ARRAY[count(*) FILTER (WHERE wait_bucket = 0), count(*) FILTER (WHERE wait_bucket = 1), count(*) FILTER (WHERE wait_bucket = 2), count(*) FILTER (WHERE wait_bucket = 3), count(*) FILTER (WHERE wait_bucket = 4), count(*) FILTER (WHERE wait_bucket = 5), count(*) FILTER (WHERE wait_bucket = 6), count(*) FILTER (WHERE wait_bucket = 7), count(*) FILTER (WHERE wait_bucket = 8), count(*) FILTER (WHERE wait_bucket = 9), count(*) FILTER (WHERE wait_bucket = 10), count(*) FILTER (WHERE wait_bucket = 11), count(*) FILTER (WHERE wait_bucket = 12), count(*) FILTER (WHERE wait_bucket = 13), count(*) FILTER (WHERE wait_bucket = 14), count(*) FILTER (WHERE wait_bucket = 15), count(*) FILTER (WHERE wait_bucket = 16), count(*) FILTER (WHERE wait_bucket = 17), count(*) FILTER (WHERE wait_bucket = 18), count(*) FILTER (WHERE wait_bucket = 19), count(*) FILTER (WHERE wait_bucket = 20), count(*) FILTER (WHERE wait_bucket = 21), count(*) FILTER (WHERE wait_bucket = 22)]::bigint[] AS wait_buckets,
           ARRAY[count(*) FILTER (WHERE run_bucket = 0), count(*) FILTER (WHERE run_bucket = 1), count(*) FILTER (WHERE run_bucket = 2), count(*) FILTER (WHERE run_bucket = 3), count(*) FILTER (WHERE run_bucket = 4), count(*) FILTER (WHERE run_bucket = 5), count(*) FILTER (WHERE run_bucket = 6), count(*) FILTER (WHERE run_bucket = 7), count(*) FILTER (WHERE run_bucket = 8), count(*) FILTER (WHERE run_bucket = 9), count(*) FILTER (WHERE run_bucket = 10), count(*) FILTER (WHERE run_bucket = 11), count(*) FILTER (WHERE run_bucket = 12), count(*) FILTER (WHERE run_bucket = 13), count(*) FILTER (WHERE run_bucket = 14), count(*) FILTER (WHERE run_bucket = 15), count(*) FILTER (WHERE run_bucket = 16), count(*) FILTER (WHERE run_bucket = 17), count(*) FILTER (WHERE run_bucket = 18), count(*) FILTER (WHERE run_bucket = 19), count(*) FILTER (WHERE run_bucket = 20), count(*) FILTER (WHERE run_bucket = 21), count(*) FILTER (WHERE run_bucket = 22)]::bigint[] AS run_buckets,
           count(*) AS tasks
    FROM finished
    GROUP BY queue, task_path
), stored AS (
    INSERT INTO tasks_activityhour AS h
        (hour, queue, task_path, succeeded, failed, cancelled, attempt_failures, timed,
         wait_sum, wait_max, run_sum, run_max, wait_buckets, run_buckets)
    SELECT %(hour)s::timestamptz, queue, task_path, succeeded, failed, cancelled, attempt_failures, timed,
           wait_sum, wait_max, run_sum, run_max, wait_buckets, run_buckets
    FROM keyed
    ORDER BY queue, task_path
    ON CONFLICT (hour, queue, task_path) DO UPDATE SET
        succeeded = EXCLUDED.succeeded, failed = EXCLUDED.failed, cancelled = EXCLUDED.cancelled,
        attempt_failures = EXCLUDED.attempt_failures, timed = EXCLUDED.timed,
        wait_sum = EXCLUDED.wait_sum, wait_max = EXCLUDED.wait_max,
        run_sum = EXCLUDED.run_sum, run_max = EXCLUDED.run_max,
        wait_buckets = EXCLUDED.wait_buckets, run_buckets = EXCLUDED.run_buckets
    RETURNING 1
), gone AS (
    -- Overwritten whole: the keys of an earlier count with no task in the hour now (retried out of
    -- it, pruned) go (their first counts stayed). Disjoint from ``stored``'s rows.
    DELETE FROM tasks_activityhour AS g
    WHERE g.hour = %(hour)s::timestamptz
      AND NOT EXISTS (SELECT 1 FROM keyed AS k WHERE k.queue = g.queue AND k.task_path = g.task_path)
      AND NOT EXISTS (SELECT 1 FROM settled)
    RETURNING 1
)
INSERT INTO tasks_activityhourmark AS m (hour, counted_at, keys, tasks)
SELECT %(hour)s::timestamptz, clock_timestamp(), (SELECT count(*) FROM stored) + 0 * (SELECT count(*) FROM gone),
       (SELECT COALESCE(sum(tasks), 0) FROM keyed)
WHERE NOT EXISTS (SELECT 1 FROM settled)
ON CONFLICT (hour) DO UPDATE SET counted_at = EXCLUDED.counted_at, keys = EXCLUDED.keys, tasks = EXCLUDED.tasks
RETURNING m.tasks;

-- name: DUE_HOURS_SQL
-- The hours of the kept window that are over (by FINAL_AFTER) and not counted yet, newest first: the
-- recent past shows first after a long pause. At most HISTORY_HOURS rows of generate_series, each a
-- primary-key probe of the marks.
SELECT h.hour
FROM generate_series(
    date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s),
    date_trunc('hour', statement_timestamp() - make_interval(secs => %(final_after)s)) - interval '1 hour',
    interval '1 hour') AS h(hour)
WHERE NOT EXISTS (SELECT 1 FROM tasks_activityhourmark AS m WHERE m.hour = h.hour)
ORDER BY h.hour DESC;

-- name: MARK_EMPTY_HOURS_SQL
-- The due hours that end before the earliest finish in tasks_task (a fresh install's window, a long
-- quiet spell) marked counted with nothing in them, all in one statement: each of them would be one
-- COUNT_HOUR_SQL finding no task, 168 on a first start (its planning alone cost 3 ms each). An hour
-- with keys stored is left to COUNT_HOUR_SQL, which deletes them. A finish is stamped with the
-- database's clock and lands in an hour not yet due; the hours at or after the earliest finish are
-- counted one by one as before. The earliest finish is the least of each final status's first entry
-- in tasks_task_prune_idx (an index of finished_at alone would cost every finish an entry more).
INSERT INTO tasks_activityhourmark AS m (hour, counted_at, keys, tasks)
SELECT h.hour, clock_timestamp(), 0, 0
FROM unnest(%(hours)s::timestamptz[]) AS h(hour)
WHERE h.hour + interval '1 hour' <= COALESCE(
        LEAST((SELECT min(finished_at) FROM tasks_task WHERE status = 'SUCCESSFUL' AND finished_at IS NOT NULL),
              (SELECT min(finished_at) FROM tasks_task WHERE status = 'FAILED' AND finished_at IS NOT NULL),
              (SELECT min(finished_at) FROM tasks_task WHERE status = 'CANCELLED' AND finished_at IS NOT NULL)),
        'infinity'::timestamptz)
  AND NOT EXISTS (SELECT 1 FROM tasks_activityhour AS a WHERE a.hour = h.hour)
ON CONFLICT (hour) DO NOTHING
RETURNING m.hour;

-- name: PRUNE_HOURS_SQL
-- Hours past the kept window (the unique index's leading column; the marks' primary key).
DELETE FROM tasks_activityhour
WHERE hour < date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s);

-- name: PRUNE_MARKS_SQL
-- The hours' marks (which hours are rolled up) past the kept window, by their primary key.
DELETE FROM tasks_activityhourmark
WHERE hour < date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s);
