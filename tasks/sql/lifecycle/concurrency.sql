-- tasks.lifecycle.concurrency: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: SWEEP_SQL
-- The recovery round's sweep (admit_waiting): a batch of the keys whose admission was skipped (their row
-- was held) and of those whose first deferred task came due while a slot is free, read from an index.
SELECT keys, admitted FROM tasks_concurrency_sweep(%(batch)s);

-- name: ADMIT_SQL
-- Admission for named keys, in key order (two sessions admitting the same keys take their locks in
-- the same order): the number each admitted, never below 0.
SELECT k, greatest(tasks_concurrency_admit(k, NULL, NULL), 0) FROM unnest(%(keys)s::text[]) AS u(k) ORDER BY k;

-- name: KEY_STATS_SQL
-- The keys worth showing: those with admitted tasks (a set bounded by the sum of the limits, read
-- from tasks_task_slot_idx) and those with waiting tasks (a loose index scan, as above), the first
-- ``limit`` of each by name. Per key: RUNNING and admitted counts (bounded by the limit), the
-- waiting count, capped, and the slots kept for handlers that outlived their rows (a handful).
WITH RECURSIVE waiting(key) AS (
    (SELECT concurrency_key FROM tasks_task WHERE status = 'BLOCKED' ORDER BY concurrency_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.concurrency_key FROM tasks_task AS t
            WHERE t.status = 'BLOCKED' AND t.concurrency_key > waiting.key ORDER BY t.concurrency_key LIMIT 1)
    FROM waiting WHERE waiting.key IS NOT NULL
), admitted(key) AS (
    (SELECT concurrency_key FROM tasks_task
     WHERE status IN ('READY', 'RUNNING') AND concurrency_key IS NOT NULL ORDER BY concurrency_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.concurrency_key FROM tasks_task AS t
            WHERE t.status IN ('READY', 'RUNNING') AND t.concurrency_key IS NOT NULL
              AND t.concurrency_key > admitted.key
            ORDER BY t.concurrency_key LIMIT 1)
    FROM admitted WHERE admitted.key IS NOT NULL
), keys AS (
    (SELECT key FROM waiting WHERE key IS NOT NULL LIMIT %(limit)s)
    UNION
    (SELECT key FROM admitted WHERE key IS NOT NULL LIMIT %(limit)s)
)
SELECT keys.key, c.max_running,
       (SELECT count(*) FROM tasks_task AS t
        WHERE t.concurrency_key = keys.key AND t.status IN ('READY', 'RUNNING') AND t.status = 'RUNNING'),
       (SELECT count(*) FROM tasks_task AS t WHERE t.concurrency_key = keys.key AND t.status IN ('READY', 'RUNNING')),
       (SELECT count(*) FROM (SELECT 1 FROM tasks_task AS t WHERE t.status = 'BLOCKED' AND t.concurrency_key = keys.key
                              LIMIT %(cap)s + 1) AS w),
       (SELECT count(*) FROM tasks_concurrencyhold AS h WHERE h.key = keys.key)
FROM keys LEFT JOIN tasks_concurrencykey AS c ON c.key = keys.key
ORDER BY keys.key;

-- name: PRUNE_IDLE_KEYS_SQL
-- A key's row holds nothing but its limit (and the lock): once none of its tasks is unfinished and
-- no enqueue set its limit for IDLE_KEY_SECONDS, it is deleted, so per-customer keys do not pile up
-- for months. Safe against a racing enqueue: that enqueue's admission inserts the row again with its
-- own limit (the limit rule is "the latest enqueue's"), and a row is deleted only under its lock
-- (SKIP LOCKED: a key being admitted right now is left for the next round).
DELETE FROM tasks_concurrencykey AS c
WHERE c.key = ANY(ARRAY(  -- run once (tasks/lifecycle/claim.py, PICK_ONE, says why)
    SELECT i.key FROM tasks_concurrencykey AS i
    WHERE i.updated_at < clock_timestamp() - make_interval(secs => %(idle)s)
      AND NOT EXISTS (SELECT 1 FROM tasks_task AS t
                      WHERE t.concurrency_key = i.key AND t.status IN ('READY', 'RUNNING'))
      AND NOT EXISTS (SELECT 1 FROM tasks_task AS t WHERE t.concurrency_key = i.key AND t.status = 'BLOCKED')
    ORDER BY i.updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))
RETURNING c.key;

-- name: KEEP_SLOTS_SQL
-- Keep the slots of attempts the worker abandons at their timeout: only keyed rows it still holds
-- (before the timeout is recorded, so the slot never counts as free in between).
INSERT INTO tasks_concurrencyhold (key, task_id, token, worker, reason)
SELECT t.concurrency_key, t.id, t.token, t.holder, %(reason)s
FROM tasks_task AS t
JOIN unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token) ON t.id = d.id AND t.token = d.token
WHERE t.holder = %(worker)s AND t.status = 'RUNNING' AND t.concurrency_key IS NOT NULL
ON CONFLICT DO NOTHING
RETURNING task_id, token;

-- name: RELEASE_KEPT_SQL
-- The handlers of these attempts have returned: their slots are free (the delete's trigger admits).
DELETE FROM tasks_concurrencyhold AS h
USING unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token)
WHERE h.task_id = d.id AND h.token = d.token AND h.worker = %(worker)s;

-- name: RELEASE_DEAD_SQL
-- Slots kept for handlers in processes known dead (stopped, or presumed dead by recovery) or never
-- registered in this database. The table holds a handful of rows: stuck handlers only.
DELETE FROM tasks_concurrencyhold AS h
WHERE NOT EXISTS (SELECT 1 FROM tasks_worker AS w WHERE w.id = h.worker AND w.stopped_at IS NULL)
RETURNING h.task_id;
