-- tasks.lifecycle.claim: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: FAIR_CTES
-- The fair pick's CTEs, at the top of the claim statement (so that its RETURNING can read the walk:
-- FAIR_CURSOR). ``walk`` and ``levels`` are recursive: the statement's WITH is WITH RECURSIVE.
-- ``walk`` starts from a row that is no key of the walk (``fair_after`` itself, taking no turn, 0
-- keys visited), so that its step (the probes for the next key and its due rows) is written once:
-- the claim's plan has 159 nodes, 229 with the step written for the first key too (101 before the
-- positions), and a prepared statement's executor sets up every node on each run.
walk(fair_key, due, wrapped, n, keys) AS (
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
    );

-- name: FAIR_CURSOR_READ_SQL
-- A fair queue's cursor shared by every claimer of the database (tasks_faircursor, tasks/models/
-- fair_cursor.py): where a new claimer's turns start, so that a worker recycled by --max-tasks, killed
-- and restarted, or deployed, deals on from where the fleet's turns went instead of from the first
-- key every life. Off the hot path: a claimer reads it once, when it starts claiming
-- from the queue, and keeps its own cursor in memory from then on (FAIR_CURSOR, from each claim);
-- it writes back at most once a second, and at a clean stop. One row per fair queue: a primary-key
-- probe.
SELECT fair_after FROM tasks_faircursor WHERE queue = %(queue)s;

-- name: FAIR_CURSOR_WRITE_SQL
-- Last writer wins: several claimers of one queue each go round the keys from their own cursor, and
-- the row only tells a claimer that starts where the others' turns have got to. Any start is as good
-- as any other for the bound (each claim's walk is bounded by its limit, and a claimer reaches every
-- key within a lap from wherever it starts); what starved tenants was every new life starting at the
-- same place. An older position written over a newer one makes a new claimer serve a few keys twice,
-- never skip one. The row changes only when the cursor does (``IS DISTINCT FROM``: a writer whose
-- value is already there leaves no dead row version); ``updated_at`` is when it last moved, on the
-- database clock.
--
-- The write never waits. An API claim writes inside its request's transaction and holds
-- the row's lock until the request commits, or longer if the request stalls; an upsert behind it
-- waited for that lock (a worker's dispatcher for its lock_timeout every round, an API request with
-- no bound at all, its claimed rows locked meanwhile). The cursor is advisory, so a writer that finds
-- the row locked leaves it (SKIP LOCKED: someone is writing a position as good as ours). The first
-- write of a queue inserts the row; two first writers would wait on each other's uncommitted insert,
-- so an insert goes only with the queue's transaction-level advisory lock taken without waiting
-- (the loser leaves it; a later write updates the row). Data-modifying CTEs run whether or not the
-- INSERT reads them.
WITH held AS (
    SELECT c.queue FROM tasks_faircursor AS c WHERE c.queue = %(queue)s FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE tasks_faircursor AS c SET fair_after = %(fair_after)s, updated_at = statement_timestamp()
    FROM held WHERE c.queue = held.queue AND c.fair_after IS DISTINCT FROM %(fair_after)s
    RETURNING c.queue
)
INSERT INTO tasks_faircursor (queue, fair_after, updated_at)
SELECT %(queue)s, %(fair_after)s, statement_timestamp()
WHERE NOT EXISTS (SELECT 1 FROM tasks_faircursor AS c WHERE c.queue = %(queue)s)
  AND pg_try_advisory_xact_lock('tasks_faircursor'::regclass::oid::integer, hashtext(%(queue)s::text))
ON CONFLICT (queue) DO NOTHING;

-- name: ISOLATED_WAITING_SQL
-- Busy workers' claims pass over a task that must run isolated, so under a steady stream no worker is
-- ever idle for it. A busy worker looks for one in its queues at most once per poll interval (the
-- worker then reserves itself for it: tasks/worker/process.py, IsolationReservation). Reads
-- tasks_task_isolation_idx, whose entries are the READY tasks that crashed beside others: a handful,
-- whatever the backlog. ``shared_crashes > 0`` is spelled out so that the partial index's predicate is
-- proven whatever ISOLATE_AFTER is.
SELECT t.queue FROM tasks_task AS t
WHERE t.status = 'READY' AND t.shared_crashes > 0 AND t.shared_crashes >= %(isolate_after)s
  AND t.queue = ANY(%(queues)s::text[]) AND t.run_after <= statement_timestamp()
  AND NOT EXISTS (SELECT 1 FROM tasks_queuecontrol AS c WHERE c.name = t.queue AND c.paused)
LIMIT 1;

-- name: CLAIM_CHOSEN_SQL
-- The claim of chosen tasks, for tasks.testing's eager mode: an enqueue runs what it inserted at once,
-- in the caller's transaction. It takes the READY rows among ``ids`` and the members of ``workflows``
-- (a workflow step a finished one released), best first, whatever their ``run_after`` (a deferred task
-- runs at once, a failed attempt is retried without its backoff), but not a task its handler snoozed
-- until later (it would be run again and again) nor one of a paused queue. Test-sized sets: it reads
-- the primary key and tasks_task_workflow_idx, never the claim index the workers share.
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
    SELECT c.id FROM tasks_task AS c
    WHERE (c.id = ANY(%(ids)s::bigint[]) OR c.workflow_id = ANY(%(workflows)s::bigint[]))
      AND c.status = 'READY' AND (c.snoozed_at IS NULL OR c.run_after <= statement_timestamp())
      AND NOT EXISTS (SELECT 1 FROM tasks_queuecontrol AS q WHERE q.name = c.queue AND q.paused)
    ORDER BY c.priority DESC, c.run_after, c.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))
RETURNING t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at, t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids, (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect, t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after, t.retry_policy, t.rate_key, t.trace_context;

-- name: CLAIM_SQL[0]
-- Each claiming statement in two forms, indexed by "claims from several queues".
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
RETURNING t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at, t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids, (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect, t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after, t.retry_policy, t.rate_key, t.trace_context;

-- name: CLAIM_SQL[1]
-- Each claiming statement in two forms, indexed by "claims from several queues".
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
RETURNING t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at, t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids, (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect, t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after, t.retry_policy, t.rate_key, t.trace_context;

-- name: FAIR_CLAIM_SQL
-- The same from one fair queue (FAIR_CTES, PICK_FAIR): each row's fair_key and the cursor come back last.
WITH RECURSIVE walk(fair_key, due, wrapped, n, keys) AS (
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
    )
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
      WHERE w.due AND NOT (w.wrapped AND COALESCE(w.fair_key > %(fair_after)s::text, false)) AND w.n = (%(limit)s::int - 1) %% (SELECT GREATEST(count(*), 1) FROM walk AS v WHERE v.due AND NOT (v.wrapped AND COALESCE(v.fair_key > %(fair_after)s::text, false))) + 1)), t.id = ANY(ARRAY(SELECT fair.id FROM fair));
