-- tasks.web.queries: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: TASK_PATHS_SQL
-- : The task paths that hold a task, each read by one index probe (a loose index scan: the next path
-- : after the last one found), from tasks_task's task-path index (READY and finished rows), from
-- : tasks_finished's, and from the awaiting and blocked rows and the running ones (at most 5,000 of
-- : each read: no task-path index holds them). At most %(limit)s paths; a cost that grows with the number of
-- : distinct paths, never with the number of tasks.
WITH RECURSIVE live(path) AS (
    (SELECT task_path FROM tasks_task WHERE status = ANY(%(not_running)s::text[]) ORDER BY task_path LIMIT 1)
    UNION ALL
    SELECT (SELECT t.task_path FROM tasks_task AS t
            WHERE t.status = ANY(%(not_running)s::text[]) AND t.task_path > live.path ORDER BY t.task_path LIMIT 1)
    FROM live WHERE live.path IS NOT NULL
), moved(path) AS (
    (SELECT task_path FROM tasks_finished ORDER BY task_path LIMIT 1)
    UNION ALL
    SELECT (SELECT f.task_path FROM tasks_finished AS f WHERE f.task_path > moved.path ORDER BY f.task_path LIMIT 1)
    FROM moved WHERE moved.path IS NOT NULL
)
SELECT DISTINCT path FROM (
    (SELECT path FROM live WHERE path IS NOT NULL LIMIT %(limit)s)
    UNION ALL
    (SELECT path FROM moved WHERE path IS NOT NULL LIMIT %(limit)s)
    UNION ALL
    (SELECT task_path FROM tasks_task WHERE status = ANY(%(own_way)s::text[]) ORDER BY status, id DESC LIMIT 5000)
    UNION ALL
    (SELECT task_path FROM tasks_task WHERE status = 'RUNNING' ORDER BY expires_at LIMIT 5000)
) AS paths;

-- name: QUEUE_STATS_SQL
-- Loose index scans over the claim index (tasks_task_claim_idx: queue, priority DESC, run_after, ...
-- WHERE READY): each step finds the next queue name after the previous one (one index descent), so
-- the cost is per queue, not per task. Per queue, the oldest waiting run_after is the smallest of the
-- first entries of each priority (the same kind of scan over the few priorities in use), and the
-- runnable depth is counted up to the cap, priority by priority: within one, run_after is the index's
-- next column, so the count reads the due entries only, never the tasks asleep until later (without
-- PostgreSQL 18's skip scan, a count over the whole queue stepped over every one of them). No index
-- of its own: every index is written by every enqueue.
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
        SELECT 1 FROM levels AS l
        CROSS JOIN LATERAL (
            SELECT 1 FROM tasks_task AS t
            WHERE t.status = 'READY' AND t.queue = l.queue AND t.priority = l.priority
              AND t.run_after <= statement_timestamp()
            LIMIT %(cap)s + 1
        ) AS due
        WHERE l.queue = oldest.queue AND l.priority IS NOT NULL
        LIMIT %(cap)s + 1
    ) AS runnable
) AS depth
WHERE depth.n > 0
ORDER BY oldest.queue;
