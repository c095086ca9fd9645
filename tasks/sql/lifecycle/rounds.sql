-- tasks.lifecycle.rounds: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: FINISH_AND_CLAIM_SQL[0]
-- Each round statement in two forms, indexed by "claims from several queues".
WITH finished AS (
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
    RETURNING t.id, t.token
), claimed AS (
    UPDATE tasks_task AS t SET 
    status = 'RUNNING',
    holder = %(worker)s::text,
    token = nextval('leasing_fence_token_seq'),
    acquired_at = clock_timestamp(),
    renewed_at = NULL,
    released_at = NULL,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewals = 0,
    transitions = t.transitions + 1,
    attempt_started = (%(start)s::boolean AND t.rate_key IS NULL),
    attempt_isolated = false,
    attempts = t.attempts + (%(start)s::boolean AND t.rate_key IS NULL)::int,
    started_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN COALESCE(t.started_at, clock_timestamp()) ELSE t.started_at END,
    last_attempted_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN clock_timestamp() ELSE t.last_attempted_at END,
    worker_ids = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN t.worker_ids || jsonb_build_array(%(worker)s::text)
                      ELSE t.worker_ids END
    
WHERE t.id = ANY(ARRAY(
    WITH RECURSIVE levels(priority) AS (
        SELECT CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < 32767
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < 32767 AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767))
        END
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < levels.priority
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < levels.priority AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority))
        END
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.priority, COALESCE((SELECT k.run_after FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority = l.priority), '-infinity') AS run_after,
               COALESCE((SELECT k.id FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority = l.priority), 0) AS id FROM levels AS l
    )
    SELECT due.id FROM placed AS l
    CROSS JOIN LATERAL (
        SELECT id FROM tasks_task
        WHERE status = 'READY' AND queue = %(queue)s AND priority = l.priority AND run_after <= statement_timestamp()
          AND (run_after, id) > (l.run_after, l.id)
          AND shared_crashes < %(isolation_bar)s
        ORDER BY run_after, id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS due
    LIMIT %(limit)s
))
    RETURNING t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at, t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids, (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect, t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after, t.retry_policy, t.rate_key, t.trace_context
), handing AS (
    UPDATE tasks_worker SET handed = %(handed)s::text::bigint[] || ARRAY(
        SELECT c.token FROM claimed AS c
        WHERE NOT c.suspect AND c.rate_key IS NULL AND c.queue <> ALL(%(rated_queues)s::text[])
        ORDER BY c.priority DESC, c.id
        LIMIT %(release)s)
    WHERE id = %(worker)s::text AND %(hand)s::boolean
)
SELECT 'c', claimed.* FROM claimed
UNION ALL
SELECT 'f', finished.id, finished.token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM finished;

-- name: FINISH_AND_CLAIM_SQL[1]
-- Each round statement in two forms, indexed by "claims from several queues".
WITH finished AS (
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
    RETURNING t.id, t.token
), claimed AS (
    UPDATE tasks_task AS t SET 
    status = 'RUNNING',
    holder = %(worker)s::text,
    token = nextval('leasing_fence_token_seq'),
    acquired_at = clock_timestamp(),
    renewed_at = NULL,
    released_at = NULL,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewals = 0,
    transitions = t.transitions + 1,
    attempt_started = (%(start)s::boolean AND t.rate_key IS NULL),
    attempt_isolated = false,
    attempts = t.attempts + (%(start)s::boolean AND t.rate_key IS NULL)::int,
    started_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN COALESCE(t.started_at, clock_timestamp()) ELSE t.started_at END,
    last_attempted_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN clock_timestamp() ELSE t.last_attempted_at END,
    worker_ids = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN t.worker_ids || jsonb_build_array(%(worker)s::text)
                      ELSE t.worker_ids END
    
WHERE t.id = ANY(ARRAY(
    WITH RECURSIVE levels(queue, priority) AS (
        SELECT u.name, CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = u.name AND k.priority < 32767) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = u.name AND t.priority < 32767
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = u.name AND t.priority < 32767 AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = u.name AND k.priority < 32767)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = u.name AND k.priority < 32767))
        END
        FROM unnest(%(queues)s::text[]) AS u(name)
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol AS c WHERE c.name = u.name AND c.paused)
        UNION ALL
        SELECT levels.queue, CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = levels.queue AND k.priority < levels.priority) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority < levels.priority
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority < levels.priority AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = levels.queue AND k.priority < levels.priority)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = levels.queue AND k.priority < levels.priority))
        END
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.queue, l.priority, COALESCE((SELECT k.run_after FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = l.queue AND k.priority = l.priority), '-infinity') AS run_after,
               COALESCE((SELECT k.id FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = l.queue AND k.priority = l.priority), 0) AS id FROM levels AS l
    )
    SELECT p.id FROM (
        SELECT best.queue, count(*) AS share FROM (
            SELECT l.queue, r.priority, r.run_after, r.id FROM placed AS l CROSS JOIN LATERAL (
                SELECT id, priority, run_after FROM tasks_task
                WHERE status = 'READY' AND queue = l.queue AND priority = l.priority
                  AND run_after <= statement_timestamp() AND (run_after, id) > (l.run_after, l.id)
                  AND shared_crashes < %(isolation_bar)s
                ORDER BY run_after, id
                LIMIT %(limit)s
            ) AS r
            ORDER BY r.priority DESC, r.run_after, r.id
            LIMIT %(limit)s
        ) AS best
        GROUP BY best.queue
    ) AS s CROSS JOIN LATERAL (
        SELECT due.id FROM placed AS l CROSS JOIN LATERAL (
            SELECT id FROM tasks_task
            WHERE status = 'READY' AND queue = s.queue AND priority = l.priority
              AND run_after <= statement_timestamp() AND (run_after, id) > (l.run_after, l.id)
              AND shared_crashes < %(isolation_bar)s
            ORDER BY run_after, id
            LIMIT s.share
            FOR UPDATE SKIP LOCKED
        ) AS due
        WHERE l.queue = s.queue
        LIMIT s.share
    ) AS p
    LIMIT %(limit)s -- cuts nothing (the shares add up to at most this); tells the planner how few rows come
))
    RETURNING t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at, t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids, (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect, t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after, t.retry_policy, t.rate_key, t.trace_context
), handing AS (
    UPDATE tasks_worker SET handed = %(handed)s::text::bigint[] || ARRAY(
        SELECT c.token FROM claimed AS c
        WHERE NOT c.suspect AND c.rate_key IS NULL AND c.queue <> ALL(%(rated_queues)s::text[])
        ORDER BY c.priority DESC, c.id
        LIMIT %(release)s)
    WHERE id = %(worker)s::text AND %(hand)s::boolean
)
SELECT 'c', claimed.* FROM claimed
UNION ALL
SELECT 'f', finished.id, finished.token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM finished;

-- name: FINISH_START_CLAIM_SQL[0]
-- The same with start markers (attempts that began and have not ended): one more modifying CTE.
WITH finished AS (
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
    RETURNING t.id, t.token
), started AS (
    UPDATE tasks_task AS t SET 
    attempt_started = true,
    attempts = t.attempts + (NOT t.attempt_started)::int,
    started_at = COALESCE(t.started_at, to_timestamp(d.at), statement_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at
                             ELSE COALESCE(to_timestamp(d.at), statement_timestamp()) END,
    worker_ids = CASE WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END
    FROM unnest(%(start_ids)s::bigint[], %(start_tokens)s::bigint[], %(start_at)s::float8[]) AS d(id, token, at)
    WHERE t.id = ANY(%(start_ids)s::bigint[]) AND t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
    RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
), claimed AS (
    UPDATE tasks_task AS t SET 
    status = 'RUNNING',
    holder = %(worker)s::text,
    token = nextval('leasing_fence_token_seq'),
    acquired_at = clock_timestamp(),
    renewed_at = NULL,
    released_at = NULL,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewals = 0,
    transitions = t.transitions + 1,
    attempt_started = (%(start)s::boolean AND t.rate_key IS NULL),
    attempt_isolated = false,
    attempts = t.attempts + (%(start)s::boolean AND t.rate_key IS NULL)::int,
    started_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN COALESCE(t.started_at, clock_timestamp()) ELSE t.started_at END,
    last_attempted_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN clock_timestamp() ELSE t.last_attempted_at END,
    worker_ids = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN t.worker_ids || jsonb_build_array(%(worker)s::text)
                      ELSE t.worker_ids END
    
WHERE t.id = ANY(ARRAY(
    WITH RECURSIVE levels(priority) AS (
        SELECT CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < 32767
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < 32767 AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767))
        END
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < levels.priority
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < levels.priority AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority))
        END
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.priority, COALESCE((SELECT k.run_after FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority = l.priority), '-infinity') AS run_after,
               COALESCE((SELECT k.id FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority = l.priority), 0) AS id FROM levels AS l
    )
    SELECT due.id FROM placed AS l
    CROSS JOIN LATERAL (
        SELECT id FROM tasks_task
        WHERE status = 'READY' AND queue = %(queue)s AND priority = l.priority AND run_after <= statement_timestamp()
          AND (run_after, id) > (l.run_after, l.id)
          AND shared_crashes < %(isolation_bar)s
        ORDER BY run_after, id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS due
    LIMIT %(limit)s
))
    RETURNING t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at, t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids, (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect, t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after, t.retry_policy, t.rate_key, t.trace_context
), handing AS (
    UPDATE tasks_worker SET handed = %(handed)s::text::bigint[] || ARRAY(
        SELECT c.token FROM claimed AS c
        WHERE NOT c.suspect AND c.rate_key IS NULL AND c.queue <> ALL(%(rated_queues)s::text[])
        ORDER BY c.priority DESC, c.id
        LIMIT %(release)s)
    WHERE id = %(worker)s::text AND %(hand)s::boolean
)
SELECT 'c', claimed.* FROM claimed
UNION ALL
SELECT 'f', finished.id, finished.token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM finished
UNION ALL
SELECT 's', started.id, started.token, NULL, NULL, NULL, started.attempts, NULL, NULL,
       started.started_at, NULL, NULL, NULL, started.last_attempted_at, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL
FROM started;

-- name: FINISH_START_CLAIM_SQL[1]
-- The same with start markers (attempts that began and have not ended): one more modifying CTE.
WITH finished AS (
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
    RETURNING t.id, t.token
), started AS (
    UPDATE tasks_task AS t SET 
    attempt_started = true,
    attempts = t.attempts + (NOT t.attempt_started)::int,
    started_at = COALESCE(t.started_at, to_timestamp(d.at), statement_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at
                             ELSE COALESCE(to_timestamp(d.at), statement_timestamp()) END,
    worker_ids = CASE WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END
    FROM unnest(%(start_ids)s::bigint[], %(start_tokens)s::bigint[], %(start_at)s::float8[]) AS d(id, token, at)
    WHERE t.id = ANY(%(start_ids)s::bigint[]) AND t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
    RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
), claimed AS (
    UPDATE tasks_task AS t SET 
    status = 'RUNNING',
    holder = %(worker)s::text,
    token = nextval('leasing_fence_token_seq'),
    acquired_at = clock_timestamp(),
    renewed_at = NULL,
    released_at = NULL,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewals = 0,
    transitions = t.transitions + 1,
    attempt_started = (%(start)s::boolean AND t.rate_key IS NULL),
    attempt_isolated = false,
    attempts = t.attempts + (%(start)s::boolean AND t.rate_key IS NULL)::int,
    started_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN COALESCE(t.started_at, clock_timestamp()) ELSE t.started_at END,
    last_attempted_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN clock_timestamp() ELSE t.last_attempted_at END,
    worker_ids = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN t.worker_ids || jsonb_build_array(%(worker)s::text)
                      ELSE t.worker_ids END
    
WHERE t.id = ANY(ARRAY(
    WITH RECURSIVE levels(queue, priority) AS (
        SELECT u.name, CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = u.name AND k.priority < 32767) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = u.name AND t.priority < 32767
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = u.name AND t.priority < 32767 AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = u.name AND k.priority < 32767)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = u.name AND k.priority < 32767))
        END
        FROM unnest(%(queues)s::text[]) AS u(name)
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol AS c WHERE c.name = u.name AND c.paused)
        UNION ALL
        SELECT levels.queue, CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = levels.queue AND k.priority < levels.priority) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority < levels.priority
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority < levels.priority AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = levels.queue AND k.priority < levels.priority)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = levels.queue AND k.priority < levels.priority))
        END
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.queue, l.priority, COALESCE((SELECT k.run_after FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = l.queue AND k.priority = l.priority), '-infinity') AS run_after,
               COALESCE((SELECT k.id FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = l.queue AND k.priority = l.priority), 0) AS id FROM levels AS l
    )
    SELECT p.id FROM (
        SELECT best.queue, count(*) AS share FROM (
            SELECT l.queue, r.priority, r.run_after, r.id FROM placed AS l CROSS JOIN LATERAL (
                SELECT id, priority, run_after FROM tasks_task
                WHERE status = 'READY' AND queue = l.queue AND priority = l.priority
                  AND run_after <= statement_timestamp() AND (run_after, id) > (l.run_after, l.id)
                  AND shared_crashes < %(isolation_bar)s
                ORDER BY run_after, id
                LIMIT %(limit)s
            ) AS r
            ORDER BY r.priority DESC, r.run_after, r.id
            LIMIT %(limit)s
        ) AS best
        GROUP BY best.queue
    ) AS s CROSS JOIN LATERAL (
        SELECT due.id FROM placed AS l CROSS JOIN LATERAL (
            SELECT id FROM tasks_task
            WHERE status = 'READY' AND queue = s.queue AND priority = l.priority
              AND run_after <= statement_timestamp() AND (run_after, id) > (l.run_after, l.id)
              AND shared_crashes < %(isolation_bar)s
            ORDER BY run_after, id
            LIMIT s.share
            FOR UPDATE SKIP LOCKED
        ) AS due
        WHERE l.queue = s.queue
        LIMIT s.share
    ) AS p
    LIMIT %(limit)s -- cuts nothing (the shares add up to at most this); tells the planner how few rows come
))
    RETURNING t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at, t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids, (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect, t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after, t.retry_policy, t.rate_key, t.trace_context
), handing AS (
    UPDATE tasks_worker SET handed = %(handed)s::text::bigint[] || ARRAY(
        SELECT c.token FROM claimed AS c
        WHERE NOT c.suspect AND c.rate_key IS NULL AND c.queue <> ALL(%(rated_queues)s::text[])
        ORDER BY c.priority DESC, c.id
        LIMIT %(release)s)
    WHERE id = %(worker)s::text AND %(hand)s::boolean
)
SELECT 'c', claimed.* FROM claimed
UNION ALL
SELECT 'f', finished.id, finished.token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM finished
UNION ALL
SELECT 's', started.id, started.token, NULL, NULL, NULL, started.attempts, NULL, NULL,
       started.started_at, NULL, NULL, NULL, started.last_attempted_at, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL
FROM started;

-- name: FAIR_FINISH_AND_CLAIM_SQL
-- The same from one fair queue: each claimed row's fair_key and the cursor come back last.
WITH RECURSIVE finished AS (
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
    RETURNING t.id, t.token
), walk(fair_key, due, wrapped, n, keys) AS (
        SELECT %(fair_after)s::text COLLATE "C", false, false, 0, 0  -- where the walk starts from: no key of it
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT e.fair_key::text COLLATE "C", d.due, e.wrapped, w.n + d.due::int, w.keys + 1
        FROM walk AS w CROSS JOIN LATERAL (SELECT a.*, w.wrapped AS wrapped FROM (SELECT e.* FROM (SELECT (SELECT p.keys FROM positioned AS p)[width_bucket((w.fair_key)::text COLLATE "C", (SELECT p.keys FROM positioned AS p)) + 1] AS next) AS p CROSS JOIN LATERAL (
            (SELECT f.fair_key::text, f.priority, f.run_after, false AS positioned FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.fair_key IS NOT NULL AND f.queue = %(queue)s AND f.fair_key > w.fair_key AND f.fair_key < p.next
                ORDER BY f.fair_key, f.priority DESC, f.run_after, f.id LIMIT 1)
            UNION ALL
            (SELECT u.* FROM (SELECT f.fair_key::text, f.priority, f.run_after, false AS positioned FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.fair_key IS NOT NULL AND f.queue = %(queue)s AND f.fair_key > w.fair_key
                ORDER BY f.fair_key, f.priority DESC, f.run_after, f.id LIMIT 1) AS u WHERE p.next IS NULL)
            UNION ALL
            SELECT p.next, NULL::smallint, NULL::timestamptz, true WHERE p.next IS NOT NULL
            LIMIT 1) AS e) AS a
            UNION ALL
            SELECT b.*, true FROM (SELECT e.* FROM (SELECT (SELECT p.keys FROM positioned AS p)[1] AS next) AS p CROSS JOIN LATERAL (
            (SELECT f.fair_key::text, f.priority, f.run_after, false AS positioned FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.fair_key IS NOT NULL AND f.queue = %(queue)s AND f.fair_key < p.next
                ORDER BY f.fair_key, f.priority DESC, f.run_after, f.id LIMIT 1)
            UNION ALL
            (SELECT u.* FROM (SELECT f.fair_key::text, f.priority, f.run_after, false AS positioned FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.fair_key IS NOT NULL AND f.queue = %(queue)s
                ORDER BY f.fair_key, f.priority DESC, f.run_after, f.id LIMIT 1) AS u WHERE p.next IS NULL)
            UNION ALL
            SELECT p.next, NULL::smallint, NULL::timestamptz, true WHERE p.next IS NOT NULL
            LIMIT 1) AS e) AS b WHERE NOT w.wrapped
            LIMIT 1) AS e
        CROSS JOIN LATERAL (SELECT CASE WHEN e.positioned THEN EXISTS (
            WITH RECURSIVE mine(priority, run_after, id) AS MATERIALIZED (
                SELECT k.priority, k.run_after, k.id FROM jsonb_to_recordset((SELECT p.map FROM positions AS p) -> e.fair_key) AS k(priority smallint, run_after timestamptz, id bigint)
            ), own(priority, run_after, id) AS (
                SELECT n.* FROM (SELECT s.priority, s.run_after, s.id
            FROM (SELECT max(m.priority) AS known FROM mine AS m) AS kn CROSS JOIN LATERAL (
                (SELECT f.priority, f.run_after, f.id - 1 AS id FROM tasks_task AS f
                 WHERE f.status = 'READY' AND f.queue = %(queue)s
                   AND f.fair_key = e.fair_key AND f.priority > COALESCE(kn.known, -32768)
                 ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1)
                UNION ALL
                (SELECT m.priority, m.run_after, m.id FROM mine AS m WHERE m.priority = kn.known)
                LIMIT 1
            ) AS s) AS n
                UNION ALL
                SELECT n.* FROM own AS o CROSS JOIN LATERAL (SELECT s.priority, s.run_after, s.id
            FROM (SELECT max(m.priority) AS known FROM mine AS m WHERE m.priority < o.priority) AS kn CROSS JOIN LATERAL (
                (SELECT f.priority, f.run_after, f.id - 1 AS id FROM tasks_task AS f
                 WHERE f.status = 'READY' AND f.queue = %(queue)s
                   AND f.fair_key = e.fair_key AND f.priority < o.priority AND f.priority > COALESCE(kn.known, -32768)
                 ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1)
                UNION ALL
                (SELECT m.priority, m.run_after, m.id FROM mine AS m WHERE m.priority = kn.known)
                LIMIT 1
            ) AS s) AS n
            )
            SELECT FROM own AS o CROSS JOIN LATERAL (
                SELECT FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.queue = %(queue)s
                  AND f.fair_key = e.fair_key AND f.priority = o.priority
                  AND (f.run_after, f.id) > (o.run_after, o.id) AND f.run_after <= statement_timestamp()
                ORDER BY f.run_after, f.id LIMIT 1) AS d) ELSE EXISTS (
            WITH RECURSIVE level(priority, run_after) AS (
                SELECT e.priority, e.run_after
                UNION ALL
                SELECT b.priority, b.run_after FROM level AS l CROSS JOIN LATERAL (
                    SELECT f.priority, f.run_after FROM tasks_task AS f
                    WHERE f.status = 'READY' AND f.queue = %(queue)s
                      AND f.fair_key = e.fair_key AND f.priority < l.priority
                    ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1) AS b
                WHERE l.run_after > statement_timestamp()
            )
            SELECT FROM level WHERE level.run_after <= statement_timestamp()) END AS due OFFSET 0) AS d
        WHERE w.n < %(limit)s AND w.keys < (%(limit)s::int * 4 + 32)
          AND NOT (w.wrapped AND COALESCE(w.fair_key >= %(fair_after)s::text, false))
    ), positions(map) AS MATERIALIZED (
        SELECT %(after_key_positions)s::jsonb
    ), positioned(keys) AS MATERIALIZED (
        SELECT array_agg(p.k ORDER BY p.k) FROM (
            SELECT k COLLATE "C" AS k FROM positions AS m, jsonb_object_keys(m.map) AS k) AS p
    ), fair AS MATERIALIZED (
        SELECT due.id FROM walk AS w CROSS JOIN LATERAL (
            WITH RECURSIVE mine(priority, run_after, id) AS MATERIALIZED (
                SELECT k.priority, k.run_after, k.id FROM jsonb_to_recordset((SELECT p.map FROM positions AS p) -> w.fair_key) AS k(priority smallint, run_after timestamptz, id bigint)
            ), own(priority, run_after, id) AS (
                SELECT n.* FROM (SELECT s.priority, s.run_after, s.id
            FROM (SELECT max(m.priority) AS known FROM mine AS m) AS kn CROSS JOIN LATERAL (
                (SELECT f.priority, f.run_after, f.id - 1 AS id FROM tasks_task AS f
                 WHERE f.status = 'READY' AND f.queue = %(queue)s
                   AND f.fair_key = w.fair_key AND f.priority > COALESCE(kn.known, -32768)
                 ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1)
                UNION ALL
                (SELECT m.priority, m.run_after, m.id FROM mine AS m WHERE m.priority = kn.known)
                LIMIT 1
            ) AS s) AS n
                UNION ALL
                SELECT n.* FROM own AS o CROSS JOIN LATERAL (SELECT s.priority, s.run_after, s.id
            FROM (SELECT max(m.priority) AS known FROM mine AS m WHERE m.priority < o.priority) AS kn CROSS JOIN LATERAL (
                (SELECT f.priority, f.run_after, f.id - 1 AS id FROM tasks_task AS f
                 WHERE f.status = 'READY' AND f.queue = %(queue)s
                   AND f.fair_key = w.fair_key AND f.priority < o.priority AND f.priority > COALESCE(kn.known, -32768)
                 ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1)
                UNION ALL
                (SELECT m.priority, m.run_after, m.id FROM mine AS m WHERE m.priority = kn.known)
                LIMIT 1
            ) AS s) AS n
            )
            SELECT r.id FROM own AS o CROSS JOIN LATERAL (
                SELECT id FROM tasks_task
                WHERE status = 'READY' AND queue = %(queue)s AND fair_key = w.fair_key AND priority = o.priority
                  AND (run_after, id) > (o.run_after, o.id)
                  AND run_after <= statement_timestamp() AND shared_crashes < %(isolation_bar)s
                ORDER BY run_after, id
                LIMIT (%(limit)s::int - w.n) / (SELECT GREATEST(count(*), 1) FROM walk AS v WHERE v.due AND NOT (v.wrapped AND COALESCE(v.fair_key > %(fair_after)s::text, false))) + 1
                FOR UPDATE SKIP LOCKED
            ) AS r
            LIMIT (%(limit)s::int - w.n) / (SELECT GREATEST(count(*), 1) FROM walk AS v WHERE v.due AND NOT (v.wrapped AND COALESCE(v.fair_key > %(fair_after)s::text, false))) + 1
        ) AS due
        WHERE w.due AND NOT (w.wrapped AND COALESCE(w.fair_key > %(fair_after)s::text, false))
        LIMIT %(limit)s
    ), levels(priority) AS (
        SELECT CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < 32767
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < 32767 AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767))
        END
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < levels.priority
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < levels.priority AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority))
        END
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.priority, COALESCE((SELECT k.run_after FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority = l.priority), '-infinity') AS run_after,
               COALESCE((SELECT k.id FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority = l.priority), 0) AS id FROM levels AS l
    ), claimed AS (
    UPDATE tasks_task AS t SET 
    status = 'RUNNING',
    holder = %(worker)s::text,
    token = nextval('leasing_fence_token_seq'),
    acquired_at = clock_timestamp(),
    renewed_at = NULL,
    released_at = NULL,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewals = 0,
    transitions = t.transitions + 1,
    attempt_started = (%(start)s::boolean AND t.rate_key IS NULL),
    attempt_isolated = false,
    attempts = t.attempts + (%(start)s::boolean AND t.rate_key IS NULL)::int,
    started_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN COALESCE(t.started_at, clock_timestamp()) ELSE t.started_at END,
    last_attempted_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN clock_timestamp() ELSE t.last_attempted_at END,
    worker_ids = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN t.worker_ids || jsonb_build_array(%(worker)s::text)
                      ELSE t.worker_ids END
    
WHERE t.id = ANY(ARRAY(
    SELECT fair.id FROM fair
    UNION ALL
    (SELECT due.id FROM placed AS l
    CROSS JOIN LATERAL (
        SELECT id FROM tasks_task
        WHERE status = 'READY' AND queue = %(queue)s AND priority = l.priority AND run_after <= statement_timestamp()
          AND (run_after, id) > (l.run_after, l.id)
          AND shared_crashes < %(isolation_bar)s
          AND NOT id = ANY(ARRAY(SELECT fair.id FROM fair))
        ORDER BY run_after, id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS due
    LIMIT %(limit)s - (SELECT count(*) FROM fair))
))
    RETURNING t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at, t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids, (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect, t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after, t.retry_policy, t.rate_key, t.trace_context, t.fair_key, COALESCE(
     (SELECT w.fair_key::text FROM walk AS w WHERE w.keys = (%(limit)s::int * 4 + 32) AND NOT (w.wrapped AND COALESCE(w.fair_key > %(fair_after)s::text, false))),
     (SELECT w.fair_key::text FROM walk AS w
      WHERE w.due AND NOT (w.wrapped AND COALESCE(w.fair_key > %(fair_after)s::text, false)) AND w.n = (%(limit)s::int - 1) %% (SELECT GREATEST(count(*), 1) FROM walk AS v WHERE v.due AND NOT (v.wrapped AND COALESCE(v.fair_key > %(fair_after)s::text, false))) + 1)), t.id = ANY(ARRAY(SELECT fair.id FROM fair))
), handing AS (
    UPDATE tasks_worker SET handed = %(handed)s::text::bigint[] || ARRAY(
        SELECT c.token FROM claimed AS c
        WHERE NOT c.suspect AND c.rate_key IS NULL AND c.queue <> ALL(%(rated_queues)s::text[])
        ORDER BY c.priority DESC, c.id
        LIMIT %(release)s)
    WHERE id = %(worker)s::text AND %(hand)s::boolean
)
SELECT 'c', claimed.* FROM claimed
UNION ALL
SELECT 'f', finished.id, finished.token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM finished;

-- name: FAIR_FINISH_START_CLAIM_SQL
-- The fair queue's round with start markers.
WITH RECURSIVE finished AS (
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
    RETURNING t.id, t.token
), walk(fair_key, due, wrapped, n, keys) AS (
        SELECT %(fair_after)s::text COLLATE "C", false, false, 0, 0  -- where the walk starts from: no key of it
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT e.fair_key::text COLLATE "C", d.due, e.wrapped, w.n + d.due::int, w.keys + 1
        FROM walk AS w CROSS JOIN LATERAL (SELECT a.*, w.wrapped AS wrapped FROM (SELECT e.* FROM (SELECT (SELECT p.keys FROM positioned AS p)[width_bucket((w.fair_key)::text COLLATE "C", (SELECT p.keys FROM positioned AS p)) + 1] AS next) AS p CROSS JOIN LATERAL (
            (SELECT f.fair_key::text, f.priority, f.run_after, false AS positioned FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.fair_key IS NOT NULL AND f.queue = %(queue)s AND f.fair_key > w.fair_key AND f.fair_key < p.next
                ORDER BY f.fair_key, f.priority DESC, f.run_after, f.id LIMIT 1)
            UNION ALL
            (SELECT u.* FROM (SELECT f.fair_key::text, f.priority, f.run_after, false AS positioned FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.fair_key IS NOT NULL AND f.queue = %(queue)s AND f.fair_key > w.fair_key
                ORDER BY f.fair_key, f.priority DESC, f.run_after, f.id LIMIT 1) AS u WHERE p.next IS NULL)
            UNION ALL
            SELECT p.next, NULL::smallint, NULL::timestamptz, true WHERE p.next IS NOT NULL
            LIMIT 1) AS e) AS a
            UNION ALL
            SELECT b.*, true FROM (SELECT e.* FROM (SELECT (SELECT p.keys FROM positioned AS p)[1] AS next) AS p CROSS JOIN LATERAL (
            (SELECT f.fair_key::text, f.priority, f.run_after, false AS positioned FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.fair_key IS NOT NULL AND f.queue = %(queue)s AND f.fair_key < p.next
                ORDER BY f.fair_key, f.priority DESC, f.run_after, f.id LIMIT 1)
            UNION ALL
            (SELECT u.* FROM (SELECT f.fair_key::text, f.priority, f.run_after, false AS positioned FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.fair_key IS NOT NULL AND f.queue = %(queue)s
                ORDER BY f.fair_key, f.priority DESC, f.run_after, f.id LIMIT 1) AS u WHERE p.next IS NULL)
            UNION ALL
            SELECT p.next, NULL::smallint, NULL::timestamptz, true WHERE p.next IS NOT NULL
            LIMIT 1) AS e) AS b WHERE NOT w.wrapped
            LIMIT 1) AS e
        CROSS JOIN LATERAL (SELECT CASE WHEN e.positioned THEN EXISTS (
            WITH RECURSIVE mine(priority, run_after, id) AS MATERIALIZED (
                SELECT k.priority, k.run_after, k.id FROM jsonb_to_recordset((SELECT p.map FROM positions AS p) -> e.fair_key) AS k(priority smallint, run_after timestamptz, id bigint)
            ), own(priority, run_after, id) AS (
                SELECT n.* FROM (SELECT s.priority, s.run_after, s.id
            FROM (SELECT max(m.priority) AS known FROM mine AS m) AS kn CROSS JOIN LATERAL (
                (SELECT f.priority, f.run_after, f.id - 1 AS id FROM tasks_task AS f
                 WHERE f.status = 'READY' AND f.queue = %(queue)s
                   AND f.fair_key = e.fair_key AND f.priority > COALESCE(kn.known, -32768)
                 ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1)
                UNION ALL
                (SELECT m.priority, m.run_after, m.id FROM mine AS m WHERE m.priority = kn.known)
                LIMIT 1
            ) AS s) AS n
                UNION ALL
                SELECT n.* FROM own AS o CROSS JOIN LATERAL (SELECT s.priority, s.run_after, s.id
            FROM (SELECT max(m.priority) AS known FROM mine AS m WHERE m.priority < o.priority) AS kn CROSS JOIN LATERAL (
                (SELECT f.priority, f.run_after, f.id - 1 AS id FROM tasks_task AS f
                 WHERE f.status = 'READY' AND f.queue = %(queue)s
                   AND f.fair_key = e.fair_key AND f.priority < o.priority AND f.priority > COALESCE(kn.known, -32768)
                 ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1)
                UNION ALL
                (SELECT m.priority, m.run_after, m.id FROM mine AS m WHERE m.priority = kn.known)
                LIMIT 1
            ) AS s) AS n
            )
            SELECT FROM own AS o CROSS JOIN LATERAL (
                SELECT FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.queue = %(queue)s
                  AND f.fair_key = e.fair_key AND f.priority = o.priority
                  AND (f.run_after, f.id) > (o.run_after, o.id) AND f.run_after <= statement_timestamp()
                ORDER BY f.run_after, f.id LIMIT 1) AS d) ELSE EXISTS (
            WITH RECURSIVE level(priority, run_after) AS (
                SELECT e.priority, e.run_after
                UNION ALL
                SELECT b.priority, b.run_after FROM level AS l CROSS JOIN LATERAL (
                    SELECT f.priority, f.run_after FROM tasks_task AS f
                    WHERE f.status = 'READY' AND f.queue = %(queue)s
                      AND f.fair_key = e.fair_key AND f.priority < l.priority
                    ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1) AS b
                WHERE l.run_after > statement_timestamp()
            )
            SELECT FROM level WHERE level.run_after <= statement_timestamp()) END AS due OFFSET 0) AS d
        WHERE w.n < %(limit)s AND w.keys < (%(limit)s::int * 4 + 32)
          AND NOT (w.wrapped AND COALESCE(w.fair_key >= %(fair_after)s::text, false))
    ), positions(map) AS MATERIALIZED (
        SELECT %(after_key_positions)s::jsonb
    ), positioned(keys) AS MATERIALIZED (
        SELECT array_agg(p.k ORDER BY p.k) FROM (
            SELECT k COLLATE "C" AS k FROM positions AS m, jsonb_object_keys(m.map) AS k) AS p
    ), fair AS MATERIALIZED (
        SELECT due.id FROM walk AS w CROSS JOIN LATERAL (
            WITH RECURSIVE mine(priority, run_after, id) AS MATERIALIZED (
                SELECT k.priority, k.run_after, k.id FROM jsonb_to_recordset((SELECT p.map FROM positions AS p) -> w.fair_key) AS k(priority smallint, run_after timestamptz, id bigint)
            ), own(priority, run_after, id) AS (
                SELECT n.* FROM (SELECT s.priority, s.run_after, s.id
            FROM (SELECT max(m.priority) AS known FROM mine AS m) AS kn CROSS JOIN LATERAL (
                (SELECT f.priority, f.run_after, f.id - 1 AS id FROM tasks_task AS f
                 WHERE f.status = 'READY' AND f.queue = %(queue)s
                   AND f.fair_key = w.fair_key AND f.priority > COALESCE(kn.known, -32768)
                 ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1)
                UNION ALL
                (SELECT m.priority, m.run_after, m.id FROM mine AS m WHERE m.priority = kn.known)
                LIMIT 1
            ) AS s) AS n
                UNION ALL
                SELECT n.* FROM own AS o CROSS JOIN LATERAL (SELECT s.priority, s.run_after, s.id
            FROM (SELECT max(m.priority) AS known FROM mine AS m WHERE m.priority < o.priority) AS kn CROSS JOIN LATERAL (
                (SELECT f.priority, f.run_after, f.id - 1 AS id FROM tasks_task AS f
                 WHERE f.status = 'READY' AND f.queue = %(queue)s
                   AND f.fair_key = w.fair_key AND f.priority < o.priority AND f.priority > COALESCE(kn.known, -32768)
                 ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1)
                UNION ALL
                (SELECT m.priority, m.run_after, m.id FROM mine AS m WHERE m.priority = kn.known)
                LIMIT 1
            ) AS s) AS n
            )
            SELECT r.id FROM own AS o CROSS JOIN LATERAL (
                SELECT id FROM tasks_task
                WHERE status = 'READY' AND queue = %(queue)s AND fair_key = w.fair_key AND priority = o.priority
                  AND (run_after, id) > (o.run_after, o.id)
                  AND run_after <= statement_timestamp() AND shared_crashes < %(isolation_bar)s
                ORDER BY run_after, id
                LIMIT (%(limit)s::int - w.n) / (SELECT GREATEST(count(*), 1) FROM walk AS v WHERE v.due AND NOT (v.wrapped AND COALESCE(v.fair_key > %(fair_after)s::text, false))) + 1
                FOR UPDATE SKIP LOCKED
            ) AS r
            LIMIT (%(limit)s::int - w.n) / (SELECT GREATEST(count(*), 1) FROM walk AS v WHERE v.due AND NOT (v.wrapped AND COALESCE(v.fair_key > %(fair_after)s::text, false))) + 1
        ) AS due
        WHERE w.due AND NOT (w.wrapped AND COALESCE(w.fair_key > %(fair_after)s::text, false))
        LIMIT %(limit)s
    ), levels(priority) AS (
        SELECT CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < 32767
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < 32767 AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < 32767))
        END
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT CASE WHEN (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority) IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < levels.priority
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = %(queue)s AND t.priority < levels.priority AND t.priority > (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority)
             ORDER BY t.priority DESC LIMIT 1),
            (SELECT max(k.priority) FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority < levels.priority))
        END
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.priority, COALESCE((SELECT k.run_after FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority = l.priority), '-infinity') AS run_after,
               COALESCE((SELECT k.id FROM unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[], %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id) WHERE k.queue = %(queue)s AND k.priority = l.priority), 0) AS id FROM levels AS l
    ), started AS (
    UPDATE tasks_task AS t SET 
    attempt_started = true,
    attempts = t.attempts + (NOT t.attempt_started)::int,
    started_at = COALESCE(t.started_at, to_timestamp(d.at), statement_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at
                             ELSE COALESCE(to_timestamp(d.at), statement_timestamp()) END,
    worker_ids = CASE WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END
    FROM unnest(%(start_ids)s::bigint[], %(start_tokens)s::bigint[], %(start_at)s::float8[]) AS d(id, token, at)
    WHERE t.id = ANY(%(start_ids)s::bigint[]) AND t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
    RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
), claimed AS (
    UPDATE tasks_task AS t SET 
    status = 'RUNNING',
    holder = %(worker)s::text,
    token = nextval('leasing_fence_token_seq'),
    acquired_at = clock_timestamp(),
    renewed_at = NULL,
    released_at = NULL,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewals = 0,
    transitions = t.transitions + 1,
    attempt_started = (%(start)s::boolean AND t.rate_key IS NULL),
    attempt_isolated = false,
    attempts = t.attempts + (%(start)s::boolean AND t.rate_key IS NULL)::int,
    started_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN COALESCE(t.started_at, clock_timestamp()) ELSE t.started_at END,
    last_attempted_at = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN clock_timestamp() ELSE t.last_attempted_at END,
    worker_ids = CASE WHEN (%(start)s::boolean AND t.rate_key IS NULL) THEN t.worker_ids || jsonb_build_array(%(worker)s::text)
                      ELSE t.worker_ids END
    
WHERE t.id = ANY(ARRAY(
    SELECT fair.id FROM fair
    UNION ALL
    (SELECT due.id FROM placed AS l
    CROSS JOIN LATERAL (
        SELECT id FROM tasks_task
        WHERE status = 'READY' AND queue = %(queue)s AND priority = l.priority AND run_after <= statement_timestamp()
          AND (run_after, id) > (l.run_after, l.id)
          AND shared_crashes < %(isolation_bar)s
          AND NOT id = ANY(ARRAY(SELECT fair.id FROM fair))
        ORDER BY run_after, id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS due
    LIMIT %(limit)s - (SELECT count(*) FROM fair))
))
    RETURNING t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at, t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids, (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect, t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after, t.retry_policy, t.rate_key, t.trace_context, t.fair_key, COALESCE(
     (SELECT w.fair_key::text FROM walk AS w WHERE w.keys = (%(limit)s::int * 4 + 32) AND NOT (w.wrapped AND COALESCE(w.fair_key > %(fair_after)s::text, false))),
     (SELECT w.fair_key::text FROM walk AS w
      WHERE w.due AND NOT (w.wrapped AND COALESCE(w.fair_key > %(fair_after)s::text, false)) AND w.n = (%(limit)s::int - 1) %% (SELECT GREATEST(count(*), 1) FROM walk AS v WHERE v.due AND NOT (v.wrapped AND COALESCE(v.fair_key > %(fair_after)s::text, false))) + 1)), t.id = ANY(ARRAY(SELECT fair.id FROM fair))
), handing AS (
    UPDATE tasks_worker SET handed = %(handed)s::text::bigint[] || ARRAY(
        SELECT c.token FROM claimed AS c
        WHERE NOT c.suspect AND c.rate_key IS NULL AND c.queue <> ALL(%(rated_queues)s::text[])
        ORDER BY c.priority DESC, c.id
        LIMIT %(release)s)
    WHERE id = %(worker)s::text AND %(hand)s::boolean
)
SELECT 'c', claimed.* FROM claimed
UNION ALL
SELECT 'f', finished.id, finished.token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM finished
UNION ALL
SELECT 's', started.id, started.token, NULL, NULL, NULL, started.attempts, NULL, NULL,
       started.started_at, NULL, NULL, NULL, started.last_attempted_at, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL
FROM started;
