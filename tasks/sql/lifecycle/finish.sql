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
WHERE t.id = ANY(%(start_ids)s::bigint[]) AND t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false)
  AND t.expires_at > clock_timestamp()
RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at;

-- name: HEARTBEAT_SQL
-- One statement renews every task the worker still holds, and records the worker as alive. Each row
-- is a compare-and-set on holder + id + TOKEN: a stale client reusing a worker name renews nothing.
-- Only the worker process's own beat (``record_worker``) writes its row: an API client's heartbeat,
-- refused or not, must not wipe the worker's stats or revive a worker recorded as stopped.
WITH mine AS (
    SELECT t.id FROM tasks_task AS t
    JOIN unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token) ON t.id = d.id AND t.token = d.token
    WHERE t.id = ANY(%(ids)s::bigint[]) AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    WHERE t.id = ANY(%(ids)s::bigint[]) AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
WHERE t.id = ANY(%(ids)s::bigint[]) AND t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
WHERE t.id = ANY(%(ids)s::bigint[]) AND t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    snoozed_at = NULL,  -- due now: no longer waiting for a wake time
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
WHERE t.id = ANY(%(ids)s::bigint[]) AND t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false)
RETURNING t.id, t.token;
