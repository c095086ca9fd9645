-- tasks.lifecycle.ratelimits: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: KEY_STATS_SQL
-- The keys at their limit (or near it): those whose window holds a grant within the last period, read
-- from the rows alone (a row per key with recent starts; tasks_task is not read). Each key's window
-- is counted in SQL on the database clock. Bounded by ``limit`` rows of the idle index's newest end.
SELECT k.key, k.max_starts, k.period,
       (SELECT count(*) FROM unnest(k.starts) AS s(at)
        WHERE s.at > clock_timestamp() - make_interval(secs => k.period))::int AS in_window,
       k.grants, k.refusals, k.retry_at, k.decided_at
FROM (SELECT * FROM tasks_ratelimit ORDER BY decided_at DESC LIMIT %(limit)s) AS k;

-- name: PRUNE_IDLE_KEYS_SQL
-- Key rows without a start for IDLE_KEY_SECONDS: their window is empty, so deleting them forgets
-- nothing but the totals; a later start inserts the row again. Locked rows are left for the next round.
DELETE FROM tasks_ratelimit AS k
WHERE k.key = ANY(ARRAY(  -- run once (tasks/lifecycle/claim.py, PICK_ONE, says why)
    SELECT i.key FROM tasks_ratelimit AS i
    -- The bound the index can take (idle, on the statement's clock: a volatile clock_timestamp() is
    -- no index bound), then each row's own (a whole period): a bound that depends on the row, or on
    -- a volatile clock, is a filter, and read every live key of the index.
    WHERE i.decided_at < statement_timestamp() - make_interval(secs => %(idle)s)
      AND i.decided_at < clock_timestamp() - make_interval(secs => i.period)
    ORDER BY i.decided_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))
RETURNING k.key;
