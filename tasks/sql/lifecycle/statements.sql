-- tasks.lifecycle.statements: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: ENQUEUE_SQL
-- A task without a dedup key cannot conflict: a plain insert. ON CONFLICT makes every insert a
-- speculative one (a speculative-insertion lock and its WAL record), a tenth of the statement's time.
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts, max_attempts, timeout, dedup_key, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, backend_alias, task_run_after, concurrency_key, concurrency_limit,
                        retry_policy, rate_key, rate_limit, rate_period, trace_context, fair_key)
VALUES (%(queue)s::text, %(priority)s::smallint, %(task_path)s::text, %(args)s::jsonb, %(kwargs)s::jsonb, 'READY',
        COALESCE(%(run_after)s::timestamptz, statement_timestamp()), statement_timestamp(), 0, %(max_attempts)s::int,
        %(timeout)s::float8, %(dedup_key)s::text, '[]'::jsonb, '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false,
        %(backend_alias)s::text,
        CASE WHEN %(backend_alias)s::text IS NULL THEN NULL ELSE %(run_after)s::timestamptz END,
        %(concurrency_key)s::text, %(concurrency_limit)s::int, %(retry_policy)s::jsonb,
        %(rate_key)s::text, %(rate_limit)s::int, %(rate_period)s::float8, %(trace_context)s::jsonb,
        %(fair_key)s::text)
RETURNING id, enqueued_at;

-- name: ENQUEUE_DEDUP_SQL
-- With a dedup key: nothing if an unfinished task holds the key (the caller then looks it up).
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts, max_attempts, timeout, dedup_key, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, backend_alias, task_run_after, concurrency_key, concurrency_limit,
                        retry_policy, rate_key, rate_limit, rate_period, trace_context, fair_key)
VALUES (%(queue)s::text, %(priority)s::smallint, %(task_path)s::text, %(args)s::jsonb, %(kwargs)s::jsonb, 'READY',
        COALESCE(%(run_after)s::timestamptz, statement_timestamp()), statement_timestamp(), 0, %(max_attempts)s::int,
        %(timeout)s::float8, %(dedup_key)s::text, '[]'::jsonb, '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false,
        %(backend_alias)s::text,
        CASE WHEN %(backend_alias)s::text IS NULL THEN NULL ELSE %(run_after)s::timestamptz END,
        %(concurrency_key)s::text, %(concurrency_limit)s::int, %(retry_policy)s::jsonb,
        %(rate_key)s::text, %(rate_limit)s::int, %(rate_period)s::float8, %(trace_context)s::jsonb,
        %(fair_key)s::text)
ON CONFLICT (dedup_key) WHERE status IN ('BLOCKED', 'READY', 'RUNNING') AND dedup_key IS NOT NULL DO NOTHING
RETURNING id, enqueued_at;

-- name: ENQUEUE_UNIQUE_SQL
-- Unique for a window (``unique_for``; tasks/lifecycle/windows.py): the key's row in tasks_uniquekey is
-- the window. ``accepted`` opens one: a new key row, or the key's row replaced by a DO UPDATE that fires
-- only once its window has passed, judged under the row's lock on its newest version (two enqueues of
-- the key queue on that lock: the second sees the first's window and takes nothing). The task's id is
-- drawn before the insert so the key row can name it. No row is proposed at all while an unfinished
-- task holds the dedup key (the dedup promise stays: a window extends it, never shortens it), so the
-- window is left as it was. ``inserted`` runs only for a key row taken; its ON CONFLICT meets only a
-- plain dedup enqueue of the same key that committed after this statement's snapshot: the key row
-- then names a task that was never inserted, which the caller sees (``enqueued_at`` NULL) and undoes
-- (RELEASE_UNIQUE_KEY_SQL). A refused duplicate still holds the key row's lock until its transaction
-- ends (ON CONFLICT DO UPDATE locks the row before it tests the WHERE): enqueues of one key inside long
-- transactions queue behind each other, as inserts of one unique value do; other keys never wait.
--
-- The window starts when the key is taken, never before. An INSERT computes its row (the clock in
-- its SELECT) before the arbiter index is checked, and that check waits for another transaction's
-- uncommitted insert of the key or delete of its row: when that one rolls back (or the delete, a
-- prune, commits), the insert goes on with the row computed before the wait, a window that may have
-- ended before the enqueue was accepted (breaker 32: 1 run in 6 through PgBouncer). So every wait
-- comes first, in ``taken``: the key's transaction-level advisory lock, which every enqueue of the key
-- through this statement takes before it inserts (an uncommitted first window of the key holds it),
-- then the lock of the key's row as the snapshot has it (a prune's uncommitted delete holds that one;
-- a row deleted meanwhile is simply not there). The clock is read after both, in ``accepted``'s
-- SELECT, whose only input is ``taken``. The lock's two halves: the table's oid (a namespace of
-- this table's own, resolved when the statement is parsed) and the key's hash, whose rare collisions
-- make two keys queue behind each other, never share a window. A transaction-level lock ends with the
-- transaction: no session state is left on a pooled connection (invariant 13). The DO UPDATE branch
-- reads its clock under the row lock already.
-- Costs: one primary-key probe of tasks_uniquekey (two with the lock) and one probe of
-- tasks_task_dedup_unfinished, whatever the number of keys or finished rows.
WITH proposed AS MATERIALIZED (
    SELECT pg_advisory_xact_lock('tasks_uniquekey'::regclass::oid::integer, hashtext(%(dedup_key)s::text))
    WHERE NOT EXISTS (SELECT 1 FROM tasks_task AS held
                      WHERE held.dedup_key = %(dedup_key)s::text AND held.status IN ('BLOCKED', 'READY', 'RUNNING'))
), taken AS MATERIALIZED (
    SELECT k.key FROM proposed LEFT JOIN (
        SELECT k.key FROM tasks_uniquekey AS k WHERE k.key = %(dedup_key)s::text FOR UPDATE
    ) AS k ON true
), accepted AS (
    INSERT INTO tasks_uniquekey AS k (key, task_id, accepted_at, expires_at)
    SELECT %(dedup_key)s::text, nextval(pg_get_serial_sequence('tasks_task', 'id')), clock_timestamp(),
           clock_timestamp() + make_interval(secs => %(unique_for)s::float8)
    FROM taken
    ON CONFLICT (key) DO UPDATE
    SET task_id = EXCLUDED.task_id, accepted_at = clock_timestamp(),
        expires_at = clock_timestamp() + make_interval(secs => %(unique_for)s::float8)
    WHERE k.expires_at <= clock_timestamp()
    RETURNING k.task_id
), inserted AS (
    INSERT INTO tasks_task (id, queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts, max_attempts, timeout, dedup_key, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, backend_alias, task_run_after, concurrency_key, concurrency_limit,
                        retry_policy, rate_key, rate_limit, rate_period, trace_context, fair_key)
    SELECT a.task_id, %(queue)s::text, %(priority)s::smallint, %(task_path)s::text, %(args)s::jsonb, %(kwargs)s::jsonb, 'READY',
        COALESCE(%(run_after)s::timestamptz, statement_timestamp()), statement_timestamp(), 0, %(max_attempts)s::int,
        %(timeout)s::float8, %(dedup_key)s::text, '[]'::jsonb, '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false,
        %(backend_alias)s::text,
        CASE WHEN %(backend_alias)s::text IS NULL THEN NULL ELSE %(run_after)s::timestamptz END,
        %(concurrency_key)s::text, %(concurrency_limit)s::int, %(retry_policy)s::jsonb,
        %(rate_key)s::text, %(rate_limit)s::int, %(rate_period)s::float8, %(trace_context)s::jsonb,
        %(fair_key)s::text FROM accepted AS a
    ON CONFLICT (dedup_key) WHERE status IN ('BLOCKED', 'READY', 'RUNNING') AND dedup_key IS NOT NULL DO NOTHING
    RETURNING id, enqueued_at
)
SELECT a.task_id, i.enqueued_at FROM accepted AS a LEFT JOIN inserted AS i ON i.id = a.task_id;

-- name: ENQUEUE_DEBOUNCE_SQL
-- Debounce (``debounce``, ``max_wait``; tasks/lifecycle/windows.py): one upsert whose arbiter is
-- tasks_task_debounce_waiting, a partial unique index on (task_path, debounce_key) over *waiting* rows
-- (BLOCKED, READY) never claimed (``transitions`` 0: only a claim bumps it) only: a key is debounced
-- per task path, and a claimed task that waits again (retry, hand-back, recovery, requeue) is never
-- folded into nor meets the key's newer task. While a task of the path and key waits, the
-- insert becomes an update of it: its arguments replaced, its start pushed to now + delay under its
-- row lock (clock_timestamp(), read after any wait for the lock), never past ``debounce_until`` (its
-- first enqueue + max_wait; LEAST ignores a NULL: no cap). Against a worker's claim: a claim that
-- committed first has taken the row out of the index, and PostgreSQL, finding the conflicting row
-- changed under its lock, checks the index again, finds no waiting row and inserts a new task; while
-- this statement holds the row lock, a claim skips the row (SKIP LOCKED); a claim whose pick saw the
-- row before this committed locks its newest version and re-checks the pick on it, finding it not yet
-- due. So a debounce never changes the arguments of an attempt already claimed. The DO UPDATE's WHERE
-- says it again, as a compare-and-set on the status and the claim count (no row: the caller tries
-- again). ``debounces`` is 0 on a row just inserted (NULL on every row not debounced) and counts the
-- enqueues folded into it. A keyed task already admitted to its concurrency key's slots (READY) whose
-- start is pushed later gives its slot up in this statement: it waits BLOCKED, and the statement's
-- own admission (the AFTER UPDATE triggers of tasks/lifecycle/concurrency.py, which an upsert's DO
-- UPDATE fires) hands the slot to the key's next due waiting task; a READY task holds a slot, so one
-- that cannot run before its new start must not be READY (breaker 32: a debounce left the slot idle
-- while the key's other tasks waited). A start that stays due (``debounce_until``, the max_wait cap,
-- already passed: LEAST keeps it) keeps the slot. The cost:
-- one probe of a unique index that holds only the waiting debounced rows.
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts, max_attempts, timeout, dedup_key, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, backend_alias, task_run_after, concurrency_key, concurrency_limit,
                        retry_policy, rate_key, rate_limit, rate_period, trace_context, fair_key, debounce_key, debounce_until, debounces)
VALUES (%(queue)s::text, %(priority)s::smallint, %(task_path)s::text, %(args)s::jsonb, %(kwargs)s::jsonb, 'READY',
        LEAST(statement_timestamp() + make_interval(secs => %(debounce)s::float8), statement_timestamp() + make_interval(secs => %(max_wait)s::float8)), statement_timestamp(), 0, %(max_attempts)s::int,
        %(timeout)s::float8, %(dedup_key)s::text, '[]'::jsonb, '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false,
        %(backend_alias)s::text,
        CASE WHEN %(backend_alias)s::text IS NULL THEN NULL ELSE %(run_after)s::timestamptz END,
        %(concurrency_key)s::text, %(concurrency_limit)s::int, %(retry_policy)s::jsonb,
        %(rate_key)s::text, %(rate_limit)s::int, %(rate_period)s::float8, %(trace_context)s::jsonb,
        %(fair_key)s::text, %(debounce_key)s::text, statement_timestamp() + make_interval(secs => %(max_wait)s::float8), 0)
ON CONFLICT (task_path, debounce_key)
    WHERE status IN ('BLOCKED', 'READY') AND debounce_key IS NOT NULL AND transitions = 0
DO UPDATE
SET args = EXCLUDED.args, kwargs = EXCLUDED.kwargs,
    run_after = LEAST(clock_timestamp() + make_interval(secs => %(debounce)s::float8), tasks_task.debounce_until),
    -- The new start is later than now unless the cap has passed (the delay is more than 0).
    status = CASE WHEN tasks_task.concurrency_key IS NOT NULL
                       AND (tasks_task.debounce_until IS NULL OR tasks_task.debounce_until > clock_timestamp())
                  THEN 'BLOCKED' ELSE tasks_task.status END,
    debounces = tasks_task.debounces + 1
WHERE tasks_task.status IN ('BLOCKED', 'READY') AND tasks_task.transitions = 0
RETURNING id, enqueued_at, debounces = 0;

-- name: BULK_ENQUEUE_SQL
-- One task kind per statement: everything but the kwargs is one scalar parameter, sent once (arrays
-- of a repeated value cost a quarter of the throughput to build, send and unpack).
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts, max_attempts, timeout, dedup_key, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, concurrency_key, concurrency_limit, retry_policy, rate_key, rate_limit,
                        rate_period, trace_context, fair_key)
SELECT d.queue, d.priority, d.task_path, d.args, d.kwargs, 'READY', COALESCE(d.run_after, statement_timestamp()),
       statement_timestamp(), 0, d.max_attempts, d.timeout, NULL, '[]'::jsonb, '[]'::jsonb, 0, 0, 0, 0, 0, 0, false,
       false, %(concurrency_key)s::text, %(concurrency_limit)s::int, %(retry_policy)s::jsonb, %(rate_key)s::text,
       %(rate_limit)s::int, %(rate_period)s::float8, %(trace_context)s::jsonb, %(fair_key)s::text
FROM (
    SELECT %(queue)s::text AS queue, %(priority)s::smallint AS priority, %(task_path)s::text AS task_path,
           %(args)s::jsonb AS args, k AS kwargs, %(run_after)s::timestamptz AS run_after,
           %(max_attempts)s::int AS max_attempts, %(timeout)s::float8 AS timeout
    FROM unnest(%(kwargs)s::jsonb[]) AS k
) AS d
RETURNING id;

-- name: FAIR_CURSOR_READ_SQL
-- A fair queue's cursor shared by every claimer of the database (tasks_faircursor, tasks/models/
-- fair_cursor.py): where a new claimer's turns start, so that a worker recycled by --max-tasks, killed
-- and restarted, or deployed, deals on from where the fleet's turns went instead of from the first
-- key every life (breaker 33). Off the hot path: a claimer reads it once, when it starts claiming
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
-- The write never waits (breaker 34). An API claim writes inside its request's transaction and holds
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
UPDATE tasks_task SET progress = %(progress)s::jsonb, progress_at = clock_timestamp()
WHERE id = %(id)s AND holder = %(worker)s AND token = %(token)s AND status = 'RUNNING'
  AND expires_at > clock_timestamp();

-- name: COMPLETE_SQL
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

-- name: FINISH_AND_CLAIM_SQL[0]
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
    WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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

-- name: FAIR_CLAIM_SQL
-- The same from one fair queue (_FAIR_CTES, _PICK_FAIR): each row's fair_key and the cursor come back last.
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

-- name: FAIR_FINISH_AND_CLAIM_SQL
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
    WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false) AND t.expires_at > clock_timestamp()
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
    started_at = COALESCE(t.started_at, clock_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at ELSE clock_timestamp() END,
    worker_ids = CASE WHEN (d.kind = 'snooze') THEN (CASE WHEN t.attempt_started THEN t.worker_ids - (-1) ELSE t.worker_ids END)
                      WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END,
    errors = CASE WHEN (d.kind = 'snooze') THEN t.errors
                  ELSE CASE WHEN (jsonb_array_length(t.errors) >= 10) THEN (t.errors - 1) ELSE t.errors END || jsonb_build_array(
        d.error || jsonb_build_object(
        'attempt', t.attempts + (NOT t.attempt_started)::int, 'worker', t.holder, 'token', t.token,
        'kind', CASE WHEN d.kind = 'cancel' THEN 'cancel' ELSE 'failure' END, 'at', clock_timestamp())) END,
    errors_dropped = t.errors_dropped + (NOT (d.kind = 'snooze') AND (jsonb_array_length(t.errors) >= 10))::int,
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(errors)s::jsonb[], %(retry)s::boolean[], %(kinds)s::text[],
            %(delays)s::float8[], %(max_attempts)s::int[])
     AS d(id, token, error, retry, kind, delay, max_attempts)
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
    errors = CASE WHEN NOT t.attempt_started THEN t.errors
                  WHEN (jsonb_array_length(t.errors) >= 10) THEN t.errors - 1 ELSE t.errors END
        || CASE WHEN t.attempt_started THEN jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts, 'worker', t.holder, 'token', t.token, 'kind', 'shutdown', 'at', clock_timestamp(),
        'exception_class_path', 'tasks.exceptions.WorkerShutdown',
        'message', %(reason)s::text, 'traceback', '')) ELSE '[]'::jsonb END,
    errors_dropped = t.errors_dropped + (t.attempt_started AND (jsonb_array_length(t.errors) >= 10))::int,
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token)
WHERE t.id = d.id AND t.token = d.token AND COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false)
RETURNING t.id, t.token;

-- name: DELETE_FINISHED_SQL
-- An operator's delete (the admin; TaskQuerySet.delete_finished): the rows named go only if every one
-- of them is finished. One that is not (a RUNNING attempt, a task still waiting) refuses the whole
-- delete and changes nothing (invariant 12): no transition deletes an unfinished row, whose worker, key
-- slot or dependants would wait for it. ``picked`` locks the rows first, in id order (FOR UPDATE: a
-- requeue or claim committing meanwhile is read as it committed), so the check and the DELETE see the
-- same statuses; the refused rows come back with their statuses, for the message.
WITH picked AS MATERIALIZED (
    SELECT t.id, t.status FROM tasks_task AS t
    WHERE t.id = ANY(%(ids)s::bigint[])
    ORDER BY t.id
    FOR UPDATE
), deleted AS (
    DELETE FROM tasks_task AS t USING picked AS p
    WHERE t.id = p.id
      AND NOT EXISTS (SELECT 1 FROM picked AS u WHERE u.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))
    RETURNING t.id
)
SELECT true, id, NULL::text FROM deleted
UNION ALL
SELECT false, id, status FROM picked WHERE status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED');

-- name: RECOVER_CTES
picked AS MATERIALIZED (
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
    errors = CASE WHEN (jsonb_array_length(t.errors) >= 10) THEN (t.errors - 1) ELSE t.errors END || jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts + (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int, 'worker', t.holder, 'token', t.token, 'at', clock_timestamp(),
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
);

-- name: RECOVER_SINCE_CTES
picked AS MATERIALIZED (
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
    errors = CASE WHEN (jsonb_array_length(t.errors) >= 10) THEN (t.errors - 1) ELSE t.errors END || jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts + (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int, 'worker', t.holder, 'token', t.token, 'at', clock_timestamp(),
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
);

-- name: RECOVER_SQL
WITH 
picked AS MATERIALIZED (
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
    errors = CASE WHEN (jsonb_array_length(t.errors) >= 10) THEN (t.errors - 1) ELSE t.errors END || jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts + (handed.id IS NOT NULL AND NOT t.attempt_started AND NOT (t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL))::int, 'worker', t.holder, 'token', t.token, 'at', clock_timestamp(),
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
-- the planner: beside an old snapshot tasks_task_running_holder_idx keeps every RUNNING version the
-- stopped worker ever had.
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
SELECT t.id, t.token, t.holder, t.status, t.errors -> -1 ->> 'token', t.errors -> -1 ->> 'kind',
       -- a snooze leaves no error entry: it landed if the row snoozed after this claim's grant
       COALESCE(t.snoozed_at >= t.acquired_at, false)
FROM tasks_task AS t
WHERE t.id = ANY(%(ids)s::bigint[]);
