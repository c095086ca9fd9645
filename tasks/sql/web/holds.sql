-- tasks.web.holds: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: HOLDS_SQL
-- What holds the waiting tasks back, for the dashboard: one statement of bounded parts (the queues with
-- Ready rows by a loose index scan, then per queue its paused switch, key slots, rate lines and
-- dependencies), each part capped so that its cost does not grow with the table.
WITH RECURSIVE waiting(queue) AS (
    -- The queues with Ready rows: a loose index scan of tasks_task_claim_idx, one descent per queue.
    (SELECT queue FROM tasks_task WHERE status = 'READY' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM tasks_task AS t WHERE t.status = 'READY' AND t.queue > waiting.queue
            ORDER BY t.queue LIMIT 1)
    FROM waiting WHERE waiting.queue IS NOT NULL
), queues AS MATERIALIZED (
    SELECT queue FROM waiting WHERE queue IS NOT NULL LIMIT %(queues)s + 1
), levels(queue, priority) AS (
    -- Each unpaused queue's priorities (the same scan, one descent per level): within a level the
    -- claim index is in run_after order, so "runnable now" is a range of it.
    SELECT q.queue, (SELECT t.priority FROM tasks_task AS t WHERE t.status = 'READY' AND t.queue = q.queue
                     ORDER BY t.priority DESC LIMIT 1)
    FROM (SELECT queue FROM queues LIMIT %(queues)s) AS q WHERE q.queue <> ALL(%(paused)s::text[])
    UNION ALL
    SELECT levels.queue, (SELECT t.priority FROM tasks_task AS t
                          WHERE t.status = 'READY' AND t.queue = levels.queue AND t.priority < levels.priority
                          ORDER BY t.priority DESC LIMIT 1)
    FROM levels WHERE levels.priority IS NOT NULL
), keys(rate_key) AS (
    -- The rate keys with waiting rows: a loose index scan of tasks_task_rate_line_idx.
    (SELECT rate_key FROM tasks_task WHERE rate_key IS NOT NULL AND status IN ('READY', 'BLOCKED')
     ORDER BY rate_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.rate_key FROM tasks_task AS t
            WHERE t.rate_key IS NOT NULL AND t.status IN ('READY', 'BLOCKED') AND t.rate_key > keys.rate_key
            ORDER BY t.rate_key LIMIT 1)
    FROM keys WHERE keys.rate_key IS NOT NULL
), lines(key, held, seen, next_due, last_due) AS (
    -- A key's rows due later, in its line's order (tasks_task_rate_line_idx: rate_key, run_after),
    -- at most cap + 1 of them; and its last due (one backward probe).
    SELECT k.rate_key, h.held, h.seen, h.next_due,
           (SELECT t.run_after FROM tasks_task AS t WHERE t.rate_key = k.rate_key AND t.status IN ('READY', 'BLOCKED')
            ORDER BY t.run_after DESC LIMIT 1)
    FROM (SELECT rate_key FROM keys WHERE rate_key IS NOT NULL LIMIT %(keys)s) AS k
    CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE w.status = 'READY' AND w.rate_refusals > 0
                                  AND w.queue <> ALL(%(paused)s::text[])) AS held,
               count(*) AS seen, min(w.run_after) AS next_due
        FROM (SELECT t.status, t.rate_refusals, t.queue, t.run_after FROM tasks_task AS t
              WHERE t.rate_key = k.rate_key AND t.status IN ('READY', 'BLOCKED')
                AND t.run_after > statement_timestamp()
              ORDER BY t.run_after LIMIT %(cap)s + 1) AS w
    ) AS h
    UNION ALL
    -- A queue-wide key's rows (no key of their own): the queue's Ready rows in claim order, at most cap + 1.
    SELECT %(prefix)s || q.name, h.held, h.seen, h.next_due, h.last_due
    FROM unnest(%(rated)s::text[]) AS q(name)
    CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE w.rate_key IS NULL AND w.rate_refusals > 0
                                  AND w.run_after > statement_timestamp()) AS held,
               count(*) AS seen,
               min(w.run_after) FILTER (WHERE w.rate_key IS NULL AND w.rate_refusals > 0
                                          AND w.run_after > statement_timestamp()) AS next_due,
               max(w.run_after) FILTER (WHERE w.rate_key IS NULL AND w.rate_refusals > 0
                                          AND w.run_after > statement_timestamp()) AS last_due
        FROM (SELECT t.rate_key, t.rate_refusals, t.run_after FROM tasks_task AS t
              WHERE t.status = 'READY' AND t.queue = q.name
              ORDER BY t.priority DESC, t.run_after, t.id LIMIT %(cap)s + 1) AS w
    ) AS h
    WHERE q.name <> ALL(%(paused)s::text[])
)
SELECT 'total', NULL, count(*), count(*), NULL::timestamptz, NULL::timestamptz
FROM (SELECT 1 FROM tasks_task WHERE status >= 'READY' AND status <= 'READY'
      ORDER BY status, id DESC LIMIT %(cap)s + 1) AS s
UNION ALL
SELECT 'queues', NULL, count(*), count(*), NULL, NULL FROM queues
UNION ALL
SELECT 'runnable', NULL, count(*), count(*), NULL, NULL
FROM (SELECT 1 FROM levels AS l
      CROSS JOIN LATERAL (SELECT 1 FROM tasks_task AS t
                          WHERE t.status = 'READY' AND t.queue = l.queue AND t.priority = l.priority
                            AND t.run_after <= statement_timestamp()
                          ORDER BY t.run_after LIMIT %(cap)s + 1) AS r
      WHERE l.priority IS NOT NULL
      LIMIT %(cap)s + 1) AS s
UNION ALL
SELECT 'paused', p.name, w.n, w.n, NULL, NULL
FROM unnest(%(paused)s::text[]) AS p(name)
CROSS JOIN LATERAL (SELECT count(*) AS n FROM (SELECT 1 FROM tasks_task AS t
                                               WHERE t.status = 'READY' AND t.queue = p.name
                                               ORDER BY t.priority DESC, t.run_after, t.id
                                               LIMIT %(cap)s + 1) AS c) AS w
UNION ALL
SELECT 'keys', NULL, count(*), count(*), NULL, NULL FROM (SELECT 1 FROM keys WHERE rate_key IS NOT NULL
                                                          LIMIT %(keys)s + 1) AS k
UNION ALL
SELECT 'rate', l.key, l.held, l.seen, l.last_due,
       -- When the key's window frees its next start (now, while it is not full).
       (SELECT CASE WHEN cardinality(w.kept) >= r.max_starts
                    THEN w.kept[cardinality(w.kept) - r.max_starts + 1] + make_interval(secs => r.period)
                    ELSE statement_timestamp() END
        FROM tasks_ratelimit AS r
        CROSS JOIN LATERAL (SELECT COALESCE(array_agg(s.at ORDER BY s.at), '{}') AS kept
                            FROM unnest(r.starts) AS s(at)
                            WHERE s.at > statement_timestamp() - make_interval(secs => r.period)) AS w
        WHERE r.key = l.key)
FROM lines AS l
UNION ALL
-- Snoozed and retrying rows from their own partial indexes (newest first, at most cap + 1 each), less
-- those a reason before them holds.
SELECT 'snoozed', NULL, count(*) FILTER (WHERE w.run_after > statement_timestamp() AND NOT w.paused AND NOT w.rated),
       count(*), NULL, NULL
FROM (SELECT t.run_after, t.queue = ANY(%(paused)s::text[]) AS paused, (t.rate_refusals > 0 AND t.run_after > statement_timestamp() AND (t.rate_key IS NOT NULL OR t.queue = ANY(%(rated)s::text[]))) AS rated
      FROM tasks_task AS t WHERE t.status = 'READY' AND t.snoozed_at IS NOT NULL
      ORDER BY t.id DESC LIMIT %(cap)s + 1) AS w
UNION ALL
SELECT 'backoff', NULL, count(*) FILTER (WHERE w.run_after > statement_timestamp() AND NOT w.paused AND NOT w.rated),
       count(*), NULL, NULL
FROM (SELECT t.run_after, t.queue = ANY(%(paused)s::text[]) AS paused, (t.rate_refusals > 0 AND t.run_after > statement_timestamp() AND (t.rate_key IS NOT NULL OR t.queue = ANY(%(rated)s::text[]))) AS rated
      FROM tasks_task AS t
      WHERE t.status = 'READY' AND t.snoozed_at IS NULL AND (t.failures > 0 OR t.crashes > 0 OR t.shared_crashes > 0)
      ORDER BY t.id DESC LIMIT %(cap)s + 1) AS w;
