-- tasks.lifecycle.finish: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: START_SQL
-- A suspect's attempt is marked before its handler runs (one statement, by the executor).
UPDATE tasks_task AS t SET 
    attempt_started = true,
    attempts = t.attempts + (NOT t.attempt_started)::int,
    started_at = COALESCE(t.started_at, to_timestamp(d.at), statement_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at
                             ELSE COALESCE(to_timestamp(d.at), statement_timestamp()) END,
    worker_ids = CASE WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END,
    attempt_isolated = %(isolated)s::boolean
FROM unnest(%(start_ids)s::bigint[], %(start_tokens)s::bigint[], %(start_at)s::float8[]) AS d(id, token, at)
WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false)
  AND t.expires_at > clock_timestamp()
RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at;

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

-- name: HEARTBEAT_SQL
-- One statement renews every task the worker still holds, and records the worker as alive. Each row
-- is a compare-and-set on holder + id + TOKEN: a stale client reusing a worker name renews nothing.
-- Only the worker process's own beat (``record_worker``) writes its row: an API client's heartbeat,
-- refused or not, must not wipe the worker's stats or revive a worker recorded as stopped.
WITH mine AS (
    SELECT t.id FROM tasks_task AS t
    JOIN unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token) ON t.id = d.id AND t.token = d.token
    WHERE COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
    FOR UPDATE OF t SKIP LOCKED
), renewed AS (
    UPDATE tasks_task AS t
    SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
        renewed_at = clock_timestamp(),
        renewals = t.renewals + 1
    FROM mine WHERE t.id = mine.id
    RETURNING t.id, t.token
), busy AS (
    SELECT t.id, t.token FROM tasks_task AS t
    JOIN unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token) ON t.id = d.id AND t.token = d.token
    WHERE COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
      AND t.id NOT IN (SELECT id FROM mine)
), unkept AS (
    -- Slots kept for this worker's handlers (tasks/lifecycle/concurrency.py) whose handler is no longer running
    -- (``live``: the attempts with a handler or a thread of theirs running in the process now): one
    -- that recovery kept after the handler had returned, or one whose release was lost. A tiny table.
    DELETE FROM tasks_concurrencyhold AS h
    WHERE h.worker = %(worker)s AND %(record_worker)s::boolean AND %(reconcile)s::boolean
      AND NOT EXISTS (SELECT 1 FROM unnest(%(live_ids)s::bigint[], %(live_tokens)s::bigint[]) AS l(id, token)
                      WHERE l.id = h.task_id AND l.token = h.token)
), seen AS (
    UPDATE tasks_worker SET previous_seen_at = last_seen_at, last_seen_at = clock_timestamp(),
                            running = %(running)s, stats = %(stats)s::jsonb, stopped_at = NULL, stop_reason = ''
    WHERE id = %(worker)s AND %(record_worker)s::boolean
    RETURNING 1
)
SELECT true, id, token FROM renewed
UNION ALL
SELECT false, id, token FROM busy;

-- name: CHECKPOINT_SQL
-- A handler's progress, stored only while this attempt holds the live lease (a fenced write).
UPDATE tasks_task SET progress = %(progress)s::jsonb, progress_at = clock_timestamp()
WHERE id = %(id)s AND holder = %(worker)s AND token = %(token)s AND status = 'RUNNING'
  AND expires_at > clock_timestamp();

-- name: COMPLETE_SQL
-- Successes alone (a round with no claim and no marker): the lighter finish, fenced like every finish,
-- each result with the time its attempt began when the start was not marked.
UPDATE tasks_task AS t SET 
    attempt_started = true,
    attempts = t.attempts + (NOT t.attempt_started)::int,
    started_at = COALESCE(t.started_at, to_timestamp(d.at), statement_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at
                             ELSE COALESCE(to_timestamp(d.at), statement_timestamp()) END,
    worker_ids = CASE WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END,
    status = 'SUCCESSFUL',
    return_value = d.return_value,
    finished_at = clock_timestamp(),
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(values)s::jsonb[], %(started)s::float8[])
         AS d(id, token, return_value, at)
WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
RETURNING t.id, t.token;

-- name: FAIL_SQL
-- A failed attempt is the handler's own outcome: it costs one of ``max_attempts``. The error entry
-- carries the attempt's token so a worker whose reply was lost can tell that this write landed.
UPDATE tasks_task AS t SET
    status = CASE WHEN ((d.kind = 'snooze') OR (d.kind = 'fail' AND d.retry AND t.failures + 1 < COALESCE(d.max_attempts, t.max_attempts))) THEN CASE WHEN t.concurrency_key IS NULL THEN 'READY' ELSE 'BLOCKED' END WHEN d.kind = 'cancel' THEN 'CANCELLED' ELSE 'FAILED' END,
    run_after = CASE WHEN (d.kind = 'snooze') THEN clock_timestamp() + make_interval(secs => COALESCE(d.delay, 0))
                     WHEN (d.kind = 'fail' AND d.retry AND t.failures + 1 < COALESCE(d.max_attempts, t.max_attempts)) THEN clock_timestamp()
                          + COALESCE(make_interval(secs => d.delay), make_interval(secs => LEAST(%(backoff_max)s, %(backoff_base)s * power(2, GREATEST(t.failures, 0))) * (0.5 + random() / 2)))
                     ELSE t.run_after END,
    finished_at = CASE WHEN ((d.kind = 'snooze') OR (d.kind = 'fail' AND d.retry AND t.failures + 1 < COALESCE(d.max_attempts, t.max_attempts))) THEN NULL ELSE clock_timestamp() END,
    failures = t.failures + (d.kind = 'fail')::int,
    max_attempts = COALESCE(d.max_attempts, t.max_attempts),
    snoozes = t.snoozes + (d.kind = 'snooze')::int,
    snoozed_at = CASE WHEN (d.kind = 'snooze') THEN clock_timestamp() END,
    attempt_started = false,
    attempt_isolated = false,
    attempts = CASE WHEN (d.kind = 'snooze') THEN t.attempts - t.attempt_started::int
                    ELSE t.attempts + (NOT t.attempt_started)::int END,
    started_at = COALESCE(t.started_at, to_timestamp(d.at), clock_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at ELSE COALESCE(to_timestamp(d.at), clock_timestamp()) END,
    worker_ids = CASE WHEN (d.kind = 'snooze') THEN (CASE WHEN t.attempt_started THEN t.worker_ids - (-1) ELSE t.worker_ids END)
                      WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END,
    errors = CASE WHEN NOT (d.kind <> 'snooze') THEN t.errors WHEN (jsonb_array_length(t.errors) >= 10) THEN (t.errors - 1) ELSE t.errors END
        || CASE WHEN (d.kind <> 'snooze') THEN jsonb_build_array(d.error || jsonb_build_object(
        'attempt', t.attempts + (NOT t.attempt_started)::int, 'worker', t.holder, 'token', t.token,
        'kind', CASE WHEN d.kind = 'cancel' THEN 'cancel' ELSE 'failure' END, 'at', clock_timestamp(),
        'started_at', CASE WHEN t.attempt_started THEN t.last_attempted_at ELSE COALESCE(to_timestamp(d.at), clock_timestamp()) END,
        'position', jsonb_array_length(t.worker_ids) + (NOT t.attempt_started)::int)) ELSE '[]'::jsonb END,
    errors_dropped = t.errors_dropped + ((d.kind <> 'snooze') AND (jsonb_array_length(t.errors) >= 10))::int,
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(errors)s::jsonb[], %(retry)s::boolean[], %(kinds)s::text[],
            %(delays)s::float8[], %(max_attempts)s::int[], %(started)s::float8[])
     AS d(id, token, error, retry, kind, delay, max_attempts, at)
WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
RETURNING t.id, t.status, t.run_after,
          -- how long until it is due again, on the database clock (the worker's log says it)
          EXTRACT(EPOCH FROM t.run_after - clock_timestamp())::float8;

-- name: HAND_BACK_SQL
-- Hand-back (graceful shutdown, or claims the worker cannot run): runnable again at once, keeping its
-- place. Nothing is charged. An interrupted attempt that had started stays counted in ``attempts``
-- (it did begin; ``worker_ids`` names it) and gets an error entry saying why it ended.
UPDATE tasks_task AS t SET
    status = 'READY',
    run_after = LEAST(t.run_after, clock_timestamp()),
    attempt_started = false,
    attempt_isolated = false,
    errors = CASE WHEN NOT (t.attempt_started) THEN t.errors WHEN (jsonb_array_length(t.errors) >= 10) THEN (t.errors - 1) ELSE t.errors END
        || CASE WHEN (t.attempt_started) THEN jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts, 'worker', t.holder, 'token', t.token, 'kind', 'shutdown', 'at', clock_timestamp(),
        'started_at', t.last_attempted_at, 'position', jsonb_array_length(t.worker_ids),
        'exception_class_path', 'tasks.exceptions.WorkerShutdown',
        'message', %(reason)s::text, 'traceback', '')) ELSE '[]'::jsonb END,
    errors_dropped = t.errors_dropped + ((t.attempt_started) AND (jsonb_array_length(t.errors) >= 10))::int,
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token)
WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false)
RETURNING t.id, t.token;
