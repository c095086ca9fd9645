-- tasks.lifecycle.recover: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: RECOVER_EXPIRED_SQL
-- Recovery's full scan: every lapsed lease (and impossible state) from the front of the expiry index;
-- each row requeued, backed off, kept BLOCKED for its stalled handler's slot, or FAILED past its limits,
-- in one statement with the error entry, the kept slot and the activity record (_recover_expired).
WITH picked AS MATERIALIZED (
    SELECT id, expires_at, holder, token FROM tasks_task
    WHERE status = 'RUNNING'
      AND (expires_at <= clock_timestamp() OR expires_at IS NULL OR holder IS NULL OR token IS NULL)
    ORDER BY expires_at NULLS FIRST
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), handed AS MATERIALIZED (
    SELECT p.id FROM picked AS p JOIN tasks_worker AS w ON w.id = p.holder
    WHERE p.token = ANY(w.handed)
    FOR KEY SHARE OF w
), recovered AS (
UPDATE tasks_task AS t SET
    status = CASE WHEN NOT (NOT (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) OR t.crashes + 1 < %(max_crashes)s) THEN 'FAILED'
                  WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) AND t.crashes > 0 THEN CASE WHEN t.concurrency_key IS NULL THEN 'READY' ELSE 'BLOCKED' END  -- backs off
                  WHEN (t.concurrency_key IS NOT NULL AND (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) AND EXISTS (
        SELECT 1 FROM tasks_worker AS w
        WHERE w.id = t.holder AND w.stopped_at IS NULL
          AND w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6))) THEN 'BLOCKED'  -- its stalled handler keeps the slot
                  ELSE 'READY' END,
    run_after = CASE WHEN NOT (NOT (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) OR t.crashes + 1 < %(max_crashes)s) OR NOT (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) OR t.crashes = 0
                     THEN LEAST(t.run_after, clock_timestamp())
                     ELSE clock_timestamp() + make_interval(secs => LEAST(%(backoff_max)s, %(backoff_base)s * power(2, GREATEST(t.crashes - 1, 0))) * (0.5 + random() / 2)) END,
    finished_at = CASE WHEN (NOT (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) OR t.crashes + 1 < %(max_crashes)s) THEN NULL ELSE clock_timestamp() END,
    crashes = t.crashes + (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at))))::int,
    shared_crashes = t.shared_crashes + (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND NOT (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at))))::int,
    unstarted_returns = t.unstarted_returns + (NOT ((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int,
    attempts = t.attempts + (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int,
    worker_ids = CASE WHEN (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN t.worker_ids || jsonb_build_array(t.holder) ELSE t.worker_ids END,
    started_at = CASE WHEN (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN COALESCE(t.started_at, t.acquired_at) ELSE t.started_at END,
    last_attempted_at = CASE WHEN (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN t.acquired_at ELSE t.last_attempted_at END,
    attempt_started = false,
    attempt_isolated = false,
    snoozed_at = NULL,  -- as after any failure: it waits for this attempt's end now, not a snooze
    errors = CASE WHEN (jsonb_array_length(t.errors) >= 10) THEN (t.errors - 1) ELSE t.errors END || jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts + (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int, 'worker', t.holder, 'token', t.token, 'at', clock_timestamp(),
        'started_at', CASE WHEN (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN t.acquired_at WHEN ((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN t.last_attempted_at END,
        'position', CASE WHEN ((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN jsonb_array_length(t.worker_ids) + (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int END,
        'kind', CASE WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) THEN 'crash' WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND NOT (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) THEN 'vanished' WHEN (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL) THEN 'orphan'
                     ELSE 'returned' END,
        'exception_class_path', 'tasks.exceptions.TaskLeaseLost',
        'message', CASE WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) THEN 'lease expired: the attempt stalled or killed its worker (charged)'
                        WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND NOT (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) THEN 'lease expired: its worker vanished with other attempts (not charged)'
                        WHEN (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL) THEN 'orphan: running without a lease; repaired by recovery'
                        ELSE 'lease expired before the attempt was known to start: returned uncharged' END,
        'traceback', '',
        'expired_at', t.expires_at,
        'recovery_delay', EXTRACT(EPOCH FROM clock_timestamp() - t.expires_at),
        'silent_for', EXTRACT(EPOCH FROM clock_timestamp() - COALESCE(t.renewed_at, t.acquired_at)))),
    errors_dropped = t.errors_dropped + (jsonb_array_length(t.errors) >= 10)::int,
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM picked LEFT JOIN handed ON handed.id = picked.id
WHERE t.id = picked.id
RETURNING t.id, t.status, EXTRACT(EPOCH FROM clock_timestamp() - picked.expires_at)::float8 AS expired_for,
          -- a grant is recovered at most once: a last error entry with this token was just added
          t.errors -> -1 ->> 'kind' AS kind,
          t.concurrency_key, t.token, t.holder, COALESCE(t.renewed_at, t.acquired_at) AS last_renewed,
          t.queue, t.attempts  -- with the holder: the fields of recovery's log record about the task
), kept AS (
    INSERT INTO tasks_concurrencyhold (key, task_id, token, worker, reason)
    SELECT r.concurrency_key, r.id, r.token, r.holder, 'lapsed' FROM recovered AS r
    WHERE r.concurrency_key IS NOT NULL AND r.kind = 'crash' AND EXISTS (
        SELECT 1 FROM tasks_worker AS w
        WHERE w.id = r.holder AND w.stopped_at IS NULL
          AND w.last_seen_at > r.last_renewed + make_interval(secs => w.ttl / 6))
    ON CONFLICT DO NOTHING
), timed AS (
    -- tasks_task as it was before the statement (one snapshot): each recovered lease's last renewal
    SELECT EXTRACT(EPOCH FROM clock_timestamp() - COALESCE(held.renewed_at, held.acquired_at))::float8 AS silent,
           recovered.expired_for
    FROM recovered JOIN tasks_task AS held ON held.id = recovered.id
), recorded AS (
    INSERT INTO tasks_activityminute AS a
        (minute, succeeded, failed, closed, final, recovered, silent_total, silent_max, delay_max)
    SELECT date_trunc('minute', clock_timestamp()), 0, 0, false, false, count(*),
           COALESCE(sum(silent), 0), COALESCE(max(silent), 0), COALESCE(max(expired_for), 0)
    FROM timed
    HAVING count(*) > 0
    ON CONFLICT (minute) DO UPDATE SET
        recovered = a.recovered + EXCLUDED.recovered,
        silent_total = a.silent_total + EXCLUDED.silent_total,
        silent_max = GREATEST(a.silent_max, EXCLUDED.silent_max),
        delay_max = GREATEST(a.delay_max, EXCLUDED.delay_max)
)
SELECT id, status, expired_for, kind, queue, attempts, holder FROM recovered;

-- name: RECOVER_EXPIRED_SINCE_SQL
-- The windowed scan between full ones: the same, for the leases that expired since the last scan's
-- start (less RECOVERY_MARGIN): a range of the expiry index, whatever the history beside an old snapshot.
WITH picked AS MATERIALIZED (
    SELECT id, expires_at, holder, token FROM tasks_task
    WHERE status = 'RUNNING' AND expires_at > %(after)s::timestamptz AND expires_at <= clock_timestamp()
    ORDER BY expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), handed AS MATERIALIZED (
    SELECT p.id FROM picked AS p JOIN tasks_worker AS w ON w.id = p.holder
    WHERE p.token = ANY(w.handed)
    FOR KEY SHARE OF w
), recovered AS (
UPDATE tasks_task AS t SET
    status = CASE WHEN NOT (NOT (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) OR t.crashes + 1 < %(max_crashes)s) THEN 'FAILED'
                  WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) AND t.crashes > 0 THEN CASE WHEN t.concurrency_key IS NULL THEN 'READY' ELSE 'BLOCKED' END  -- backs off
                  WHEN (t.concurrency_key IS NOT NULL AND (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) AND EXISTS (
        SELECT 1 FROM tasks_worker AS w
        WHERE w.id = t.holder AND w.stopped_at IS NULL
          AND w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6))) THEN 'BLOCKED'  -- its stalled handler keeps the slot
                  ELSE 'READY' END,
    run_after = CASE WHEN NOT (NOT (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) OR t.crashes + 1 < %(max_crashes)s) OR NOT (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) OR t.crashes = 0
                     THEN LEAST(t.run_after, clock_timestamp())
                     ELSE clock_timestamp() + make_interval(secs => LEAST(%(backoff_max)s, %(backoff_base)s * power(2, GREATEST(t.crashes - 1, 0))) * (0.5 + random() / 2)) END,
    finished_at = CASE WHEN (NOT (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) OR t.crashes + 1 < %(max_crashes)s) THEN NULL ELSE clock_timestamp() END,
    crashes = t.crashes + (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at))))::int,
    shared_crashes = t.shared_crashes + (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND NOT (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at))))::int,
    unstarted_returns = t.unstarted_returns + (NOT ((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int,
    attempts = t.attempts + (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int,
    worker_ids = CASE WHEN (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN t.worker_ids || jsonb_build_array(t.holder) ELSE t.worker_ids END,
    started_at = CASE WHEN (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN COALESCE(t.started_at, t.acquired_at) ELSE t.started_at END,
    last_attempted_at = CASE WHEN (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN t.acquired_at ELSE t.last_attempted_at END,
    attempt_started = false,
    attempt_isolated = false,
    snoozed_at = NULL,  -- as after any failure: it waits for this attempt's end now, not a snooze
    errors = CASE WHEN (jsonb_array_length(t.errors) >= 10) THEN (t.errors - 1) ELSE t.errors END || jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts + (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int, 'worker', t.holder, 'token', t.token, 'at', clock_timestamp(),
        'started_at', CASE WHEN (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN t.acquired_at WHEN ((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN t.last_attempted_at END,
        'position', CASE WHEN ((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) THEN jsonb_array_length(t.worker_ids) + (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int END,
        'kind', CASE WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) THEN 'crash' WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND NOT (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) THEN 'vanished' WHEN (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL) THEN 'orphan'
                     ELSE 'returned' END,
        'exception_class_path', 'tasks.exceptions.TaskLeaseLost',
        'message', CASE WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) THEN 'lease expired: the attempt stalled or killed its worker (charged)'
                        WHEN (((t.attempt_started OR (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))) AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)) AND NOT (t.attempt_isolated OR EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at)))) THEN 'lease expired: its worker vanished with other attempts (not charged)'
                        WHEN (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL) THEN 'orphan: running without a lease; repaired by recovery'
                        ELSE 'lease expired before the attempt was known to start: returned uncharged' END,
        'traceback', '',
        'expired_at', t.expires_at,
        'recovery_delay', EXTRACT(EPOCH FROM clock_timestamp() - t.expires_at),
        'silent_for', EXTRACT(EPOCH FROM clock_timestamp() - COALESCE(t.renewed_at, t.acquired_at)))),
    errors_dropped = t.errors_dropped + (jsonb_array_length(t.errors) >= 10)::int,
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM picked LEFT JOIN handed ON handed.id = picked.id
WHERE t.id = picked.id
RETURNING t.id, t.status, EXTRACT(EPOCH FROM clock_timestamp() - picked.expires_at)::float8 AS expired_for,
          -- a grant is recovered at most once: a last error entry with this token was just added
          t.errors -> -1 ->> 'kind' AS kind,
          t.concurrency_key, t.token, t.holder, COALESCE(t.renewed_at, t.acquired_at) AS last_renewed,
          t.queue, t.attempts  -- with the holder: the fields of recovery's log record about the task
), kept AS (
    INSERT INTO tasks_concurrencyhold (key, task_id, token, worker, reason)
    SELECT r.concurrency_key, r.id, r.token, r.holder, 'lapsed' FROM recovered AS r
    WHERE r.concurrency_key IS NOT NULL AND r.kind = 'crash' AND EXISTS (
        SELECT 1 FROM tasks_worker AS w
        WHERE w.id = r.holder AND w.stopped_at IS NULL
          AND w.last_seen_at > r.last_renewed + make_interval(secs => w.ttl / 6))
    ON CONFLICT DO NOTHING
), timed AS (
    -- tasks_task as it was before the statement (one snapshot): each recovered lease's last renewal
    SELECT EXTRACT(EPOCH FROM clock_timestamp() - COALESCE(held.renewed_at, held.acquired_at))::float8 AS silent,
           recovered.expired_for
    FROM recovered JOIN tasks_task AS held ON held.id = recovered.id
), recorded AS (
    INSERT INTO tasks_activityminute AS a
        (minute, succeeded, failed, closed, final, recovered, silent_total, silent_max, delay_max)
    SELECT date_trunc('minute', clock_timestamp()), 0, 0, false, false, count(*),
           COALESCE(sum(silent), 0), COALESCE(max(silent), 0), COALESCE(max(expired_for), 0)
    FROM timed
    HAVING count(*) > 0
    ON CONFLICT (minute) DO UPDATE SET
        recovered = a.recovered + EXCLUDED.recovered,
        silent_total = a.silent_total + EXCLUDED.silent_total,
        silent_max = GREATEST(a.silent_max, EXCLUDED.silent_max),
        delay_max = GREATEST(a.delay_max, EXCLUDED.delay_max)
)
SELECT id, status, expired_for, kind, queue, attempts, holder FROM recovered;

-- name: RELEASE_STRAY_LEASES_SQL
-- A lease left live on a row that is not running (it can only come from hand edits or a bug):
-- release it, so the lease state querysets and the dashboard stay truthful.
UPDATE tasks_task SET released_at = clock_timestamp(), expires_at = LEAST(expires_at, clock_timestamp())
WHERE status <> 'RUNNING' AND released_at IS NULL AND expires_at IS NOT NULL
RETURNING id;

-- name: EXPIRE_ORPHANS_SQL
-- Running tasks held by a worker that has already said it stopped (or was found dead): it will never
-- heartbeat or finish them, so there is no reason to wait for the TTL. Expire them now; recovery
-- requeues them.
-- Only workers that stopped within twice their TTL: an older one's leases have all expired (its last
-- renewal was before it stopped), and recovery's own pick takes those. Its rows are found by their
-- live leases (expires_at still ahead: tasks_task_running_exp_idx) with the holder test hidden from
-- the planner: a holder index once held every RUNNING version the stopped worker ever had, which an
-- old snapshot kept (the holder index has no running rows since migration 0045; the expiry index is
-- still the one read, whatever the planner thinks of a holder's share of the running set).
UPDATE tasks_task AS t SET expires_at = clock_timestamp()
FROM tasks_worker AS w
WHERE t.status = 'RUNNING' AND t.expires_at > clock_timestamp() AND COALESCE(t.holder, '') = w.id
  AND w.stopped_at IS NOT NULL AND w.stopped_at > clock_timestamp() - make_interval(secs => 2 * w.ttl)
RETURNING t.id;

-- name: MARK_DEAD_WORKERS_SQL
-- Workers that have not been seen for more than twice their own TTL are dead (SIGKILL, power loss):
-- say so, with the reason, so the workers page does not fill with ghosts that look alive.
UPDATE tasks_worker SET
    stopped_at = clock_timestamp(),
    stop_reason = format('presumed dead: silent for %%ss (more than twice its %%ss TTL)',
                         round(EXTRACT(EPOCH FROM clock_timestamp() - last_seen_at)::numeric, 1), ttl)
WHERE stopped_at IS NULL AND last_seen_at < clock_timestamp() - make_interval(secs => 2 * ttl)
RETURNING id;

-- name: HELD_SQL
-- After a connection error the worker cannot know whether its last statement committed. It asks:
-- what does the database say it holds under its id, and where did the attempts it was finishing end?
SELECT id, token, attempt_started FROM tasks_task WHERE holder = %(worker)s AND status = 'RUNNING';

-- name: ATTEMPT_FATE_SQL
-- Where did the attempts it was finishing end? Each row's holder, token, status and last error entry:
-- the worker's outcome landed when that entry (or a snooze after the grant) is its own token's.
SELECT t.id, t.token, t.holder, t.status, t.errors -> -1 ->> 'token', t.errors -> -1 ->> 'kind',
       -- a snooze leaves no error entry: it landed if the row snoozed after this claim's grant
       COALESCE(t.snoozed_at >= t.acquired_at, false)
FROM tasks_task AS t
WHERE t.id = ANY(%(ids)s::bigint[]);
