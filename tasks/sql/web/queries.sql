-- tasks.web.queries: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: QUEUE_STATS_SQL
-- Loose index scans over the claim index (tasks_task_claim_idx: queue, priority DESC, run_after, ...
-- WHERE READY): each step finds the next queue name after the previous one (one index descent), so
-- the cost is per queue, not per task. Per queue, the oldest waiting run_after is the smallest of the
-- first entries of each priority (the same kind of scan over the few priorities in use), and the
-- runnable depth is counted up to the cap. No index of its own: every index is written by every enqueue.
WITH RECURSIVE waiting(queue) AS (
    (SELECT queue FROM tasks_task WHERE status = 'READY' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM tasks_task AS t WHERE t.status = 'READY' AND t.queue > waiting.queue
            ORDER BY t.queue LIMIT 1)
    FROM waiting WHERE waiting.queue IS NOT NULL
), levels(queue, priority) AS (
    SELECT w.queue, (SELECT t.priority FROM tasks_task AS t WHERE t.status = 'READY' AND t.queue = w.queue
                     ORDER BY t.priority DESC LIMIT 1)
    FROM (SELECT queue FROM waiting WHERE queue IS NOT NULL LIMIT %(queues)s) AS w
    UNION ALL
    SELECT levels.queue, (SELECT t.priority FROM tasks_task AS t
                          WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority < levels.priority
                          ORDER BY t.priority DESC LIMIT 1)
    FROM levels WHERE levels.priority IS NOT NULL
), oldest(queue, run_after) AS (
    SELECT levels.queue, min((SELECT t.run_after FROM tasks_task AS t
                              WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority = levels.priority
                              ORDER BY t.run_after LIMIT 1))
    FROM levels WHERE levels.priority IS NOT NULL
    GROUP BY levels.queue
)
SELECT oldest.queue, depth.n, EXTRACT(EPOCH FROM statement_timestamp() - oldest.run_after)::float8
FROM oldest
CROSS JOIN LATERAL (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM tasks_task AS t
        WHERE t.status = 'READY' AND t.queue = oldest.queue AND t.run_after <= statement_timestamp()
        LIMIT %(cap)s + 1
    ) AS runnable
) AS depth
WHERE depth.n > 0
ORDER BY oldest.queue;
