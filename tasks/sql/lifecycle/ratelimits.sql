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

-- name: RATE_START_SQL
-- The grant: a rate-limited attempt's start, taken under its key's row lock if the key has a start
-- left in its period, else refused with when to come back (the row waits in line: READY, or BLOCKED
-- for a keyed task, giving its slot up). Strict: at most max_starts grants in any window of a period;
-- the line's rules above (tasks/lifecycle/ratelimits.py has the user's side).
WITH mine AS MATERIALIZED (
    SELECT t.id, COALESCE(t.rate_key, %(key)s::text) AS rate_key,
           CASE WHEN t.rate_key IS NULL THEN %(limit)s::int ELSE t.rate_limit END AS rate_limit,
           CASE WHEN t.rate_key IS NULL THEN %(period)s::float8 ELSE t.rate_period END AS rate_period,
           t.rate_refusals > 0 AS in_line, t.attempt_started, t.rate_key IS NULL AS queue_wide
    FROM tasks_task AS t
    WHERE t.id = %(id)s::bigint AND t.token = %(token)s::bigint AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
      AND COALESCE(t.rate_key, %(key)s::text) IS NOT NULL
    FOR NO KEY UPDATE OF t
), slot AS (
    INSERT INTO tasks_ratelimit AS k (key, max_starts, period, starts, next_due, grants, refusals, retry_at,
                                      promised_until, decided_at, granted)
    SELECT m.rate_key, m.rate_limit, m.rate_period, ARRAY[c.now], c.now, 1, 0, NULL, NULL, c.now, true
    FROM mine AS m, (SELECT clock_timestamp() AS now) AS c WHERE NOT m.attempt_started
    ON CONFLICT (key) DO UPDATE SET (max_starts, period, starts, next_due, grants, refusals, retry_at,
                                     promised_until, decided_at, granted) = (
        SELECT excluded.max_starts, excluded.period,
               CASE WHEN d.granted THEN w.kept || c.now ELSE w.kept END,
               CASE WHEN d.granted OR l.in_line THEN k.next_due ELSE d.sent_to + make_interval(secs => excluded.period / excluded.max_starts) END,
               k.grants + d.granted::int,
               k.refusals + (NOT d.granted)::int,
               CASE WHEN d.granted THEN k.retry_at ELSE d.sent_to END,
               CASE WHEN NOT d.granted AND l.in_line THEN d.sent_to ELSE k.promised_until END,
               c.now,
               d.granted
        FROM (SELECT clock_timestamp() AS now) AS c
        CROSS JOIN LATERAL (
            SELECT COALESCE(array_agg(s.at ORDER BY s.at), '{}') AS kept, count(*)::int AS n
            FROM unnest(k.starts) AS s(at) WHERE s.at > c.now - make_interval(secs => excluded.period)
        ) AS w
        CROSS JOIN LATERAL (
            SELECT w.n >= excluded.max_starts AS full,
                   w.kept[w.n - excluded.max_starts + 1] + make_interval(secs => excluded.period) AS frees,
                   (SELECT m.in_line FROM mine AS m) AS in_line,
                   CASE WHEN (SELECT m.queue_wide FROM mine AS m) THEN k.next_due ELSE LEAST(k.next_due, COALESCE(
                   (SELECT r.run_after FROM tasks_task AS r
                    WHERE r.rate_key = excluded.key AND r.status IN ('READY', 'BLOCKED') AND r.run_after > c.now
                    ORDER BY r.run_after DESC LIMIT 1) + make_interval(secs => excluded.period) + make_interval(secs => excluded.period / excluded.max_starts),
                   '-infinity')) END AS tail,
                   GREATEST(c.now, k.promised_until) AS promised
        ) AS l
        CROSS JOIN LATERAL (
            SELECT NOT l.full AND (l.in_line OR (l.tail <= c.now AND l.promised <= c.now)) AS granted,
                   CASE WHEN l.in_line
                        THEN COALESCE((SELECT min(s.at) + make_interval(secs => excluded.period) FROM unnest(w.kept) AS s(at)
                                       WHERE s.at + make_interval(secs => excluded.period) > l.promised),
                                      l.promised + make_interval(secs => excluded.period / excluded.max_starts))
                        ELSE GREATEST(l.tail, CASE WHEN l.full THEN l.frees END, l.promised + make_interval(secs => excluded.period / excluded.max_starts)) END
                       AS sent_to
        ) AS d
    )
    RETURNING k.granted, k.decided_at, k.retry_at
), started AS (
    UPDATE tasks_task AS t SET
        attempt_started = true,
        attempt_isolated = %(isolated)s::boolean,
        attempts = t.attempts + 1,
        started_at = COALESCE(t.started_at, s.decided_at),
        last_attempted_at = s.decided_at,
        worker_ids = t.worker_ids || jsonb_build_array(t.holder)
    FROM mine AS m, slot AS s
    WHERE t.id = m.id AND s.granted
    RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
), refused AS (
    UPDATE tasks_task AS t SET
        status = CASE WHEN t.concurrency_key IS NULL THEN 'READY' ELSE 'BLOCKED' END,
        run_after = s.retry_at,
        rate_refusals = t.rate_refusals + 1,
        snoozed_at = NULL,  -- it waits for its key's next start now, not a wake time
        attempt_started = false,
        attempt_isolated = false,
        released_at = clock_timestamp(),
        expires_at = LEAST(t.expires_at, clock_timestamp())
    FROM mine AS m, slot AS s
    WHERE t.id = m.id AND NOT s.granted
    RETURNING t.id, t.token, t.run_after
)
SELECT true, id, token, attempts, started_at, last_attempted_at, NULL::float8 FROM started
UNION ALL  -- with the seconds until it is due: the worker looks for it then (it was not NOTIFYed)
SELECT false, id, token, NULL, NULL, run_after, EXTRACT(EPOCH FROM run_after - clock_timestamp())::float8 FROM refused
UNION ALL  -- sent again after a lost reply: the first copy granted it (nothing else starts a rate-limited claim)
SELECT true, t.id, t.token, t.attempts, t.started_at, t.last_attempted_at, NULL
FROM tasks_task AS t JOIN mine AS m ON t.id = m.id WHERE m.attempt_started;
