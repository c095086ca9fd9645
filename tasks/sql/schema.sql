-- The functions, triggers and indexes of django-leasing (the tasks and leasing apps) as they stand after
-- every migration, each kind ordered by name: the text PostgreSQL runs. Generated from a migrated database
-- (pg_get_functiondef, pg_get_triggerdef, pg_get_indexdef; the opt-in argument-search indexes of
-- `manage.py tasks_search_index` are not among them); do not edit. Change a migration, migrate, then
-- regenerate:
--     python manage.py tasks_schema --write
-- tests/db/test_schema_sql.py fails while this file and a migrated database differ.

CREATE OR REPLACE FUNCTION public.tasks_concurrency_admit(k text, lim integer, limit_id bigint)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
DECLARE
    cap integer;
    set_by bigint;
    woken timestamptz;
    pending_limit integer;
    pending_id bigint;
    held integer;
    admitted integer := 0;
    due_by timestamptz;
    next_due timestamptz;
BEGIN
    -- The key's row lock serialises admissions to the key (held until the transaction ends).
    SELECT c.max_running, c.limit_task_id, c.wake_at INTO cap, set_by, woken
    FROM tasks_concurrencykey AS c WHERE c.key = k
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        -- A row someone else holds (an insert would wait for their uncommitted version: noted
        -- instead), or no row yet: the key's first enqueue inserts it. That insert waits only for
        -- another transaction's uncommitted first insert of the same key (two first enqueues of one
        -- new key); keys are taken in key order by every statement, so that cannot deadlock.
        PERFORM 1 FROM tasks_concurrencykey AS c WHERE c.key = k;
        IF FOUND THEN
            INSERT INTO tasks_concurrencywake (key, max_running, limit_task_id, noted_at)
            VALUES (k, lim, limit_id, clock_timestamp());
            RETURN -1;
        END IF;
        INSERT INTO tasks_concurrencykey AS c (key, max_running, limit_task_id, updated_at)
        VALUES (k, COALESCE(lim, (SELECT b.concurrency_limit FROM tasks_task AS b
                                  WHERE b.status = 'BLOCKED' AND b.concurrency_key = k LIMIT 1), 1),
                limit_id, clock_timestamp())
        ON CONFLICT (key) DO NOTHING
        RETURNING c.max_running, c.limit_task_id INTO cap, set_by;
        IF NOT FOUND THEN
            INSERT INTO tasks_concurrencywake (key, max_running, limit_task_id, noted_at)
            VALUES (k, lim, limit_id, clock_timestamp());
            RETURN -1;
        END IF;
    END IF;
    -- Admissions skipped while the row was held are this one's now (before the count below, so a
    -- release noted after this snapshot keeps its note for the next admission or the sweep); the
    -- latest limit they carry competes with ours.
    WITH g AS (DELETE FROM tasks_concurrencywake AS w WHERE w.key = k RETURNING w.max_running, w.limit_task_id)
    SELECT g.max_running, g.limit_task_id INTO pending_limit, pending_id
    FROM g WHERE g.limit_task_id IS NOT NULL
    ORDER BY g.limit_task_id DESC LIMIT 1;
    IF pending_id IS NOT NULL AND (limit_id IS NULL OR pending_id > limit_id) THEN
        lim := pending_limit;
        limit_id := pending_id;
    END IF;
    IF lim IS NOT NULL AND limit_id IS NOT NULL AND (set_by IS NULL OR limit_id > set_by) THEN
        UPDATE tasks_concurrencykey SET max_running = lim, limit_task_id = limit_id, updated_at = clock_timestamp()
        WHERE key = k;
        cap := lim;
    END IF;
    -- A new snapshot (each query of a VOLATILE function takes one), taken after the lock: every
    -- admission to the key committed before is visible, and none can commit while we hold it.
    SELECT count(*) INTO held FROM tasks_task WHERE concurrency_key = k AND status IN ('READY', 'RUNNING');
    -- Handlers still running after their row stopped counting keep their slots (this migration).
    held := held + (SELECT count(*) FROM tasks_concurrencyhold AS h WHERE h.key = k);
    due_by := clock_timestamp();
    IF held < cap THEN
        PERFORM set_config('leasing.concurrency_admitting', k, true);
        -- The key's priorities walked one index probe each (0011 says why), the due rows of each.
        -- SKIP LOCKED: a waiting row locked by someone else is being cancelled, deleted or edited;
        -- their statement admits for the key when it is done.
        UPDATE tasks_task AS t SET status = 'READY'
        WHERE t.id = ANY(ARRAY(
            WITH RECURSIVE levels(priority) AS (
                (SELECT b.priority FROM tasks_task AS b
                 WHERE b.status = 'BLOCKED' AND b.concurrency_key = k
                 ORDER BY b.priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT b.priority FROM tasks_task AS b
                        WHERE b.status = 'BLOCKED' AND b.concurrency_key = k AND b.priority < levels.priority
                        ORDER BY b.priority DESC LIMIT 1)
                FROM levels WHERE levels.priority IS NOT NULL
            )
            SELECT due.id FROM levels CROSS JOIN LATERAL (
                SELECT b.id FROM tasks_task AS b
                WHERE b.status = 'BLOCKED' AND b.concurrency_key = k AND b.priority = levels.priority
                  AND b.run_after <= due_by
                ORDER BY b.run_after, b.id
                LIMIT cap - held
                FOR UPDATE SKIP LOCKED
            ) AS due
            LIMIT cap - held
        ));
        GET DIAGNOSTICS admitted = ROW_COUNT;
        PERFORM set_config('leasing.concurrency_admitting', '', true);
    END IF;
    -- When must the sweep come back? Only if a slot is still free: when the first waiting task
    -- that is not due yet comes due (per priority, the first entry past due_by; the smallest).
    -- A full key needs no sweep: the statement that frees a slot admits for it.
    IF held + admitted < cap THEN
        WITH RECURSIVE levels(priority) AS (
            (SELECT b.priority FROM tasks_task AS b
             WHERE b.status = 'BLOCKED' AND b.concurrency_key = k
             ORDER BY b.priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT b.priority FROM tasks_task AS b
                    WHERE b.status = 'BLOCKED' AND b.concurrency_key = k AND b.priority < levels.priority
                    ORDER BY b.priority DESC LIMIT 1)
            FROM levels WHERE levels.priority IS NOT NULL
        )
        SELECT min((SELECT b.run_after FROM tasks_task AS b
                    WHERE b.status = 'BLOCKED' AND b.concurrency_key = k AND b.priority = levels.priority
                      AND b.run_after > due_by
                    ORDER BY b.run_after LIMIT 1))
        INTO next_due
        FROM levels WHERE levels.priority IS NOT NULL;
    END IF;
    IF next_due IS DISTINCT FROM woken THEN
        UPDATE tasks_concurrencykey SET wake_at = next_due WHERE key = k;
    END IF;
    RETURN admitted;
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_concurrency_after_delete()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    k text;
BEGIN
    IF current_setting('leasing.concurrency_touched', true) IS DISTINCT FROM 'on' THEN
        RETURN NULL;
    END IF;
    FOR k IN
        SELECT DISTINCT o.concurrency_key FROM old_rows AS o
        WHERE o.concurrency_key IS NOT NULL AND o.status IN ('READY', 'RUNNING')
        ORDER BY 1
    LOOP
        PERFORM tasks_concurrency_admit(k, NULL, NULL);
    END LOOP;
    RETURN NULL;
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_concurrency_after_insert()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    item record;
BEGIN
    IF current_setting('leasing.concurrency_touched', true) IS DISTINCT FROM 'on' THEN
        RETURN NULL;
    END IF;
    -- Per key, the limit of the statement's last enqueue (the largest id).
    FOR item IN
        SELECT DISTINCT ON (n.concurrency_key) n.concurrency_key AS key, n.concurrency_limit AS lim, n.id
        FROM inserted AS n WHERE n.concurrency_key IS NOT NULL
        ORDER BY n.concurrency_key, n.id DESC
    LOOP
        PERFORM tasks_concurrency_admit(item.key, item.lim, item.id);
    END LOOP;
    RETURN NULL;
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_concurrency_after_release()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    k text;
BEGIN
    FOR k IN SELECT DISTINCT o.key FROM released AS o ORDER BY 1 LOOP
        PERFORM tasks_concurrency_admit(k, NULL, NULL);
    END LOOP;
    RETURN NULL;
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_concurrency_after_update()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    k text;
BEGIN
    IF current_setting('leasing.concurrency_touched', true) IS DISTINCT FROM 'on' THEN
        RETURN NULL;
    END IF;
    -- The keys of the rows that are neither READY nor RUNNING now: a slot freed, a task waiting or
    -- come due earlier are among them (the row trigger's WHEN raised the flag for exactly those).
    -- The new rows alone, not joined to the old ones: a transition table has no statistics, and a
    -- nested loop over the two made a cancel over 2,000 keys take 3 s (quadratic in rows).
    FOR k IN
        SELECT DISTINCT n.concurrency_key FROM new_rows AS n
        WHERE n.concurrency_key IS NOT NULL AND n.status NOT IN ('READY', 'RUNNING')
        ORDER BY 1
    LOOP
        PERFORM tasks_concurrency_admit(k, NULL, NULL);
    END LOOP;
    RETURN NULL;
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_concurrency_changed()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM tasks_concurrency_flag();
        RETURN NULL;
    END IF;
    IF NEW.concurrency_key IS DISTINCT FROM OLD.concurrency_key
       OR NEW.concurrency_limit IS DISTINCT FROM OLD.concurrency_limit THEN
        RAISE EXCEPTION 'the concurrency key and limit of a task cannot change' USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.status = 'READY' AND OLD.status <> 'READY' THEN
        IF OLD.status = 'BLOCKED' AND current_setting('leasing.concurrency_admitting', true) = OLD.concurrency_key THEN
            RETURN NULL;  -- the admission itself
        END IF;
        -- Into the queue from outside the key (a requeue of a finished task, an edit): back to
        -- waiting (nobody else can have seen it READY: not committed), and the admission decides
        -- (this nested statement's own triggers run it).
        UPDATE tasks_task SET status = 'BLOCKED' WHERE id = NEW.id AND status = 'READY';
        RETURN NULL;
    ELSIF NEW.status = 'RUNNING' AND OLD.status <> 'RUNNING' AND OLD.status <> 'READY' THEN
        RAISE EXCEPTION 'a task with a concurrency key runs only once admitted' USING ERRCODE = 'check_violation';
    END IF;
    -- It left READY/RUNNING (a slot may be free), it waits now, or its wait was moved.
    PERFORM tasks_concurrency_flag();
    RETURN NULL;
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_concurrency_flag()
 RETURNS void
 LANGUAGE sql
AS $function$
    SELECT set_config('leasing.concurrency_touched', 'on', true) WHERE
        current_setting('leasing.concurrency_touched', true) IS DISTINCT FROM 'on';
$function$;

CREATE OR REPLACE FUNCTION public.tasks_concurrency_inserted()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF NEW.concurrency_limit IS NULL OR NEW.concurrency_limit < 1 THEN
        RAISE EXCEPTION 'a task with a concurrency_key needs a concurrency_limit of at least 1'
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.status = 'READY' THEN
        NEW.status := 'BLOCKED';
    ELSIF NEW.status = 'RUNNING' THEN
        -- As for an update: a keyed task runs only once admitted (a restore of RUNNING rows
        -- loads them with triggers disabled, as pg_restore --disable-triggers does).
        RAISE EXCEPTION 'a task with a concurrency key runs only once admitted' USING ERRCODE = 'check_violation';
    END IF;
    PERFORM tasks_concurrency_flag();
    RETURN NEW;
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_concurrency_sweep(batch integer, OUT keys integer, OUT admitted integer)
 RETURNS record
 LANGUAGE plpgsql
AS $function$
DECLARE
    k text;
    n integer;
    due_by timestamptz;
BEGIN
    keys := 0;
    admitted := 0;
    FOR k IN
        SELECT DISTINCT s.key FROM (SELECT w.key FROM tasks_concurrencywake AS w ORDER BY w.id LIMIT batch) AS s
        ORDER BY 1
    LOOP
        n := tasks_concurrency_admit(k, NULL, NULL);
        keys := keys + 1;
        admitted := admitted + greatest(n, 0);
    END LOOP;
    -- The clock read once, into a value: compared with clock_timestamp() itself (volatile) the
    -- condition was a filter on each index entry, and the scan read every key with a wake_at, due or
    -- not (50,000 entries for none due), instead of a range bound of the index.
    due_by := clock_timestamp();
    FOR k IN
        SELECT d.key FROM (
            SELECT c.key FROM tasks_concurrencykey AS c
            WHERE c.wake_at <= due_by
            ORDER BY c.wake_at LIMIT batch
        ) AS d ORDER BY 1
    LOOP
        n := tasks_concurrency_admit(k, NULL, NULL);
        keys := keys + 1;
        admitted := admitted + greatest(n, 0);
    END LOOP;
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_report_to_parent()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    event_name text := 'task:' || NEW.id;
    woken boolean;
BEGIN
    UPDATE tasks_task AS t SET run_after = LEAST(t.run_after, statement_timestamp())
    WHERE t.id = (SELECT p.id FROM tasks_task AS p WHERE p.id = NEW.awaited_by FOR UPDATE SKIP LOCKED)
      AND t.status IN ('READY', 'BLOCKED')
      AND EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'wait:' || event_name)
      AND NOT EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'event:' || event_name);
    woken := FOUND;
    INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)
    SELECT p.id, event_name,
           jsonb_build_object('status', NEW.status, 'result', NEW.return_value, 'error', NEW.errors -> -1),
           clock_timestamp(), woken
    FROM tasks_task AS p
    WHERE p.id = NEW.awaited_by AND p.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
    ON CONFLICT (task_id, name) DO NOTHING;
    RETURN NULL;
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_task_notify_finished()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
            BEGIN
                PERFORM pg_notify('leasing_task_finished', NEW.id::text);
                RETURN NULL;
            END $function$;

CREATE OR REPLACE FUNCTION public.tasks_task_notify_inserted()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
            BEGIN
                PERFORM pg_notify('leasing_tasks', q.queue)
                FROM (SELECT DISTINCT queue FROM inserted_rows WHERE status = 'READY') AS q;
                RETURN NULL;
            END $function$;

CREATE OR REPLACE FUNCTION public.tasks_task_notify_ready()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
            BEGIN
                PERFORM pg_notify('leasing_tasks', NEW.queue);
                RETURN NULL;
            END $function$;

CREATE OR REPLACE FUNCTION public.tasks_workflow_mark()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    RETURN NULL;  -- never called: its trigger's WHEN clause counts the move and is false
END $function$;

CREATE OR REPLACE FUNCTION public.tasks_workflow_settle()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    pending integer;
    moved bigint[];
    settles smallint[];
    flows bigint[];
    waiting bigint[];
    counts integer[];
    pipes boolean[];
    callbacks bigint[];
    callback_counts integer[];
    dooms boolean;
    doomed bigint[];
    several boolean;
    edged boolean;
    released bigint[];
    lock_key integer;
    reopens boolean;
    held bigint[];
    rethink bigint[];
    reopened bigint[];
    undone bigint[];
    uncounted bigint[];
BEGIN
    pending := COALESCE(NULLIF(current_setting('leasing.workflow_settle', true), ''), '0')::int;
    IF pending <= 0 THEN
        RETURN NULL;  -- no member of a workflow changed status in this transaction (every plain one)
    END IF;
    -- settle: 1 became SUCCESSFUL, 2 became FAILED or CANCELLED, -1 / -2 reopened from them;
    -- 3 / 4 became SUCCESSFUL in a group nothing joined (callback_only), a member / its callback:
    -- a member's one dependant is the callback, counted on the workflow row, and the callback has
    -- none, so neither reads the edges.
    SELECT array_agg(m.id), array_agg(m.settle), array_agg(m.workflow_id), count(DISTINCT m.workflow_id) > 1,
           bool_or(m.settle < 3)
    INTO moved, settles, flows, several, edged
    FROM (SELECT n.id, n.workflow_id,
                 (CASE WHEN n.status = 'SUCCESSFUL' AND w.id IS NOT NULL
                       THEN CASE WHEN n.id = w.callback_id THEN 4 ELSE 3 END
                       WHEN n.status = 'SUCCESSFUL' THEN 1
                       WHEN n.status IN ('FAILED', 'CANCELLED') THEN 2
                       WHEN o.status = 'SUCCESSFUL' THEN -1
                       ELSE -2 END)::smallint AS settle
          FROM settled_rows AS n JOIN old_rows AS o ON o.id = n.id
          LEFT JOIN tasks_workflow AS w ON w.id = n.workflow_id AND w.callback_only
          WHERE n.workflow_id IS NOT NULL
            AND (n.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))
                IS DISTINCT FROM (o.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))) AS m;
    IF moved IS NULL THEN
        RETURN NULL;  -- the moves counted are an enclosing statement's: its own trigger settles them
    END IF;
    PERFORM set_config('leasing.workflow_settle', GREATEST(pending - cardinality(moved), 0)::text, true);
    -- Serialise on each workflow before reading another row of it (issue 38): a statement that reopens
    -- a member (an operator's requeue) reads its parents' statuses, and one that makes a member final
    -- counts down dependants that wait; each read what the other had not committed, and a dependant
    -- waited for ever behind a final parent. Reopening takes the workflow's transaction-level lock
    -- alone; finishing takes it shared (finishes never wait for each other: their counts go through
    -- row locks). Whichever comes second waits for the first to commit, and then reads what it wrote
    -- (each statement below takes a new snapshot). In lock-key order, so two statements of several
    -- workflows never wait in a cycle; a statement holding this lock alone waits for no row another
    -- finish holds (it updates its own rows, AWAITING rows no finish has locked yet, and unclaimed
    -- dependants it skips when locked).
    FOR lock_key, reopens IN
        SELECT hashint8(m.flow), bool_or(m.settle < 0) FROM unnest(flows, settles) AS m(flow, settle)
        GROUP BY 1 ORDER BY 1
    LOOP
        IF reopens THEN
            PERFORM pg_advisory_xact_lock('tasks_workflow'::regclass::oid::integer, lock_key);
        ELSE
            PERFORM pg_advisory_xact_lock_shared('tasks_workflow'::regclass::oid::integer, lock_key);
        END IF;
    END LOOP;
    IF edged THEN
        SELECT array_agg(x.child ORDER BY x.child) FILTER (WHERE NOT x.grouped),
               array_agg(x.n ORDER BY x.child) FILTER (WHERE NOT x.grouped),
               array_agg(x.pipe ORDER BY x.child) FILTER (WHERE NOT x.grouped),
               array_agg(x.child) FILTER (WHERE x.grouped),
               array_agg(x.n) FILTER (WHERE x.grouped),
               bool_or(x.doom)
        INTO waiting, counts, pipes, callbacks, callback_counts, dooms
        FROM (SELECT d.child_id AS child, sum(CASE WHEN m.settle > 0 THEN 1 ELSE -1 END)::int AS n,
                     bool_or(d.pipe) AS pipe, bool_or(m.settle = 2 AND d.on_failure = 'cancel') AS doom,
                     bool_or(w.id IS NOT NULL) AS grouped
              FROM unnest(moved, settles, flows) AS m(id, settle, flow)
              JOIN tasks_taskdependency AS d ON d.parent_id = m.id
              LEFT JOIN tasks_workflow AS w ON w.id = m.flow AND w.kind = 'group' AND w.callback_id = d.child_id
              WHERE m.settle < 3
              GROUP BY d.child_id) AS x;
    END IF;
    IF edged AND EXISTS (SELECT 1 FROM unnest(settles) AS m(settle) WHERE m.settle < 0) THEN
        -- Dependants of a reopened parent that have not started (READY, snoozed or not, or BLOCKED)
        -- wait for its rerun again (issue 38): they are rethought below with the requeued members.
        -- One a worker is claiming this instant (its row locked) is skipped: it runs, as a RUNNING one
        -- does. Members this statement reopened itself are rethought anyway.
        SELECT array_agg(h.id) INTO held FROM (
            SELECT t.id FROM tasks_task AS t
            WHERE t.id IN (SELECT x.child FROM unnest(waiting, counts) AS x(child, n) WHERE x.n < 0
                           UNION ALL
                           SELECT cb.child FROM unnest(callbacks, callback_counts) AS cb(child, n) WHERE cb.n < 0)
              AND t.status IN ('READY', 'BLOCKED') AND t.id <> ALL(moved)
            ORDER BY t.id FOR NO KEY UPDATE SKIP LOCKED) AS h;
    END IF;
    IF dooms THEN
        -- Dependants of members that failed or were cancelled, under on_failure = 'cancel', and
        -- theirs down the graph: cancelled in one statement (its own trigger then counts them and
        -- settles their 'run' dependants).
        WITH RECURSIVE doom(id) AS (
            SELECT d.child_id FROM unnest(moved, settles) AS m(id, settle)
            JOIN tasks_taskdependency AS d ON d.parent_id = m.id
            WHERE m.settle = 2 AND d.on_failure = 'cancel'
            UNION
            SELECT d.child_id FROM doom JOIN tasks_taskdependency AS d ON d.parent_id = doom.id
            WHERE d.on_failure = 'cancel'
        )
        SELECT array_agg(doom.id ORDER BY doom.id) INTO doomed FROM doom;
    END IF;
    IF doomed IS NOT NULL OR cardinality(waiting) > 1 THEN
        PERFORM 1 FROM tasks_task
        WHERE id = ANY(COALESCE(waiting, '{}'::bigint[]) || COALESCE(doomed, '{}'::bigint[])) AND status = 'AWAITING'
        ORDER BY id FOR NO KEY UPDATE;
    END IF;
    IF doomed IS NOT NULL THEN
        UPDATE tasks_task AS c SET
            status = 'CANCELLED',
            finished_at = clock_timestamp(),
            waiting_on = 0,
            errors = c.errors || jsonb_build_array(jsonb_build_object(
                'attempt', c.attempts, 'kind', 'dependency', 'at', clock_timestamp(),
                'exception_class_path', 'tasks.exceptions.DependencyFailed',
                'message', (SELECT format('cancelled: task %s, which it depends on, ended %s', p.id,
                                          CASE WHEN p.id = ANY(doomed) THEN 'CANCELLED' ELSE p.status END)
                            FROM tasks_taskdependency AS d JOIN tasks_task AS p ON p.id = d.parent_id
                            WHERE d.child_id = c.id AND (p.status IN ('FAILED', 'CANCELLED') OR p.id = ANY(doomed))
                            ORDER BY p.id LIMIT 1),
                'traceback', ''))
        WHERE c.id = ANY(doomed) AND c.status = 'AWAITING';
    END IF;
    IF waiting IS NOT NULL THEN
        -- The rest count down by their parents that became final (up by those reopened); at zero
        -- they are released, their parents' results in the first argument (a placeholder until
        -- then) if piped.
        UPDATE tasks_task AS c SET
            waiting_on = GREATEST(c.waiting_on - x.n, 0),
            status = CASE WHEN c.waiting_on - x.n <= 0 THEN 'READY' ELSE 'AWAITING' END,
            -- Behind what is queued already at its priority, from the finishing statement's start
            -- (statement_timestamp(): the notify trigger wakes the workers for rows due by then).
            run_after = CASE WHEN c.waiting_on - x.n <= 0 THEN GREATEST(c.run_after, statement_timestamp())
                             ELSE c.run_after END,
            args = CASE WHEN c.waiting_on - x.n <= 0 AND x.pipe THEN jsonb_set(c.args, '{0}', (
                            SELECT CASE WHEN count(*) = 1 THEN COALESCE((array_agg(p.return_value))[1], 'null')
                                        ELSE jsonb_agg(p.return_value ORDER BY p.id) END
                            FROM tasks_taskdependency AS d JOIN tasks_task AS p ON p.id = d.parent_id
                            WHERE d.child_id = c.id))
                        ELSE c.args END
        FROM unnest(waiting, counts, pipes) AS x(child_id, n, pipe)
        WHERE c.id = x.child_id AND c.status = 'AWAITING';
    END IF;
    -- Dependants requeued by this statement (an operator's requeue made them READY), and those held
    -- back above, wait again for their parents as they stand now: AWAITING while one is not final,
    -- cancelled again when one failed under 'cancel' (requeue the parent first, or both at once).
    SELECT array_agg(m.id) INTO reopened FROM unnest(moved, settles) AS m(id, settle) WHERE m.settle < 0;
    rethink := reopened || held;
    IF rethink IS NOT NULL THEN
        -- A member this statement reopened that the update below makes final again (cancelled again,
        -- or down the graph from one that is) is counted here alone, as the net of both (issue 56): the
        -- settles of the nested statements pass over it. Counted there, its count-down came before
        -- this statement's count-up and found nothing to take (remaining never goes below 0): the
        -- workflow stayed RUNNING with every member final.
        PERFORM set_config('leasing.workflow_reopened', COALESCE(reopened, '{}')::text, true);
        UPDATE tasks_task AS c SET
            status = CASE WHEN r.doomed THEN 'CANCELLED' ELSE 'AWAITING' END,
            finished_at = CASE WHEN r.doomed THEN clock_timestamp() ELSE NULL END,
            waiting_on = CASE WHEN r.doomed OR r.grouped THEN 0 ELSE r.unfinished END,
            errors = CASE WHEN r.doomed THEN c.errors || jsonb_build_array(jsonb_build_object(
                         'attempt', c.attempts, 'kind', 'dependency', 'at', clock_timestamp(),
                         'exception_class_path', 'tasks.exceptions.DependencyFailed',
                         'message', 'cancelled again: a task it depends on ended FAILED or CANCELLED',
                         'traceback', '')) ELSE c.errors END
        FROM (SELECT m.id,
                     count(*) FILTER (WHERE p.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))::int AS unfinished,
                     COALESCE(bool_or(p.status IN ('FAILED', 'CANCELLED') AND d.on_failure = 'cancel'), false) AS doomed,
                     bool_or(w.id IS NOT NULL) AS grouped
              FROM unnest(rethink) AS m(id)
              JOIN tasks_task AS me ON me.id = m.id
              JOIN tasks_taskdependency AS d ON d.child_id = m.id
              JOIN tasks_task AS p ON p.id = d.parent_id
              LEFT JOIN tasks_workflow AS w ON w.id = me.workflow_id AND w.kind = 'group' AND w.callback_id = m.id
              GROUP BY m.id) AS r
        WHERE c.id = r.id AND c.status IN ('READY', 'BLOCKED') AND (r.doomed OR r.unfinished > 0);
        PERFORM set_config('leasing.workflow_reopened', '', true);
        SELECT array_agg(t.id) INTO undone FROM tasks_task AS t
        WHERE t.id = ANY(reopened) AND t.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED');
    END IF;
    IF several THEN
        PERFORM 1 FROM tasks_workflow WHERE id = ANY(flows) ORDER BY id FOR NO KEY UPDATE;
    END IF;
    -- Each workflow counts its members; a group's callback is released when the members it waits
    -- for are all final. A member reopened and made final again in one statement counts as its net:
    -- nothing, or one more failed when it had succeeded (a reopened member has parents, so it is
    -- no group's member: no callback counts it). Inside that statement (uncounted), its enclosing
    -- settle counts it; a workflow with nothing left to count is not written.
    uncounted := NULLIF(current_setting('leasing.workflow_reopened', true), '')::bigint[];
    WITH counted AS (
        UPDATE tasks_workflow AS w SET
            remaining = GREATEST(w.remaining - x.done + x.reopened, 0),
            failed = GREATEST(w.failed + x.bad - x.unbad, 0),
            callback_waiting = GREATEST(w.callback_waiting - x.grouped - COALESCE(
                (SELECT sum(cb.n) FROM unnest(callbacks, callback_counts) AS cb(child, n)
                 WHERE cb.child = w.callback_id), 0), 0),
            status = CASE WHEN w.remaining - x.done + x.reopened > 0
                          THEN CASE WHEN w.status = 'CANCELLED' AND x.reopened = 0 THEN 'CANCELLED' ELSE 'RUNNING' END
                          WHEN w.status = 'CANCELLED' THEN 'CANCELLED'
                          WHEN w.failed + x.bad - x.unbad > 0 THEN 'FAILED'
                          ELSE 'SUCCESSFUL' END,
            finished_at = CASE WHEN w.remaining - x.done + x.reopened > 0 THEN NULL ELSE clock_timestamp() END
        FROM (SELECT m.flow,
                     count(*) FILTER (WHERE m.settle > 0) AS done,
                     count(*) FILTER (WHERE m.settle < 0 AND NOT m.undone) AS reopened,
                     count(*) FILTER (WHERE m.settle = 2 OR m.settle = -1 AND m.undone) AS bad,
                     count(*) FILTER (WHERE m.settle = -2 AND NOT m.undone) AS unbad,
                     count(*) FILTER (WHERE m.settle = 3) AS grouped
              FROM (SELECT u.flow, u.settle, u.id = ANY(COALESCE(undone, '{}')) AS undone
                    FROM unnest(moved, flows, settles) AS u(id, flow, settle)
                    WHERE u.id <> ALL(COALESCE(uncounted, '{}'))) AS m
              GROUP BY m.flow
              HAVING bool_or(NOT m.undone OR m.settle = -1)) AS x
        WHERE w.id = x.flow
        RETURNING w.kind, w.callback_id, w.callback_waiting
    )
    SELECT array_agg(counted.callback_id ORDER BY counted.callback_id) INTO released
    FROM counted WHERE counted.kind = 'group' AND counted.callback_waiting = 0;
    IF released IS NULL THEN
        RETURN NULL;  -- no group's callback is due: no statement on tasks_task (nor its triggers)
    END IF;
    UPDATE tasks_task AS c SET
        waiting_on = 0,
        status = 'READY',
        run_after = GREATEST(c.run_after, statement_timestamp()),
        args = CASE WHEN EXISTS (SELECT 1 FROM tasks_taskdependency AS d WHERE d.child_id = c.id AND d.pipe)
                    THEN jsonb_set(c.args, '{0}', (SELECT jsonb_agg(p.return_value ORDER BY p.id)
                                                   FROM tasks_taskdependency AS d
                                                   JOIN tasks_task AS p ON p.id = d.parent_id
                                                   WHERE d.child_id = c.id))
                    ELSE c.args END
    WHERE c.id = ANY(released) AND c.status = 'AWAITING';
    RETURN NULL;
END $function$;

CREATE TRIGGER tasks_concurrency_delete AFTER DELETE ON tasks_task FOR EACH ROW WHEN (old.concurrency_key IS NOT NULL AND (old.status::text = ANY (ARRAY['READY'::character varying, 'RUNNING'::character varying]::text[]))) EXECUTE FUNCTION tasks_concurrency_changed();

CREATE TRIGGER tasks_concurrency_deleted_rows AFTER DELETE ON tasks_task REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION tasks_concurrency_after_delete();

CREATE TRIGGER tasks_concurrency_insert BEFORE INSERT ON tasks_task FOR EACH ROW WHEN (new.concurrency_key IS NOT NULL) EXECUTE FUNCTION tasks_concurrency_inserted();

CREATE TRIGGER tasks_concurrency_inserted_rows AFTER INSERT ON tasks_task REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION tasks_concurrency_after_insert();

CREATE TRIGGER tasks_concurrency_released AFTER DELETE ON tasks_concurrencyhold REFERENCING OLD TABLE AS released FOR EACH STATEMENT EXECUTE FUNCTION tasks_concurrency_after_release();

CREATE TRIGGER tasks_concurrency_update AFTER UPDATE ON tasks_task FOR EACH ROW WHEN ((old.concurrency_key IS NOT NULL OR new.concurrency_key IS NOT NULL) AND (old.concurrency_key::text IS DISTINCT FROM new.concurrency_key::text OR old.concurrency_limit IS DISTINCT FROM new.concurrency_limit OR old.status::text IS DISTINCT FROM new.status::text AND NOT ((old.status::text = ANY (ARRAY['READY'::character varying, 'RUNNING'::character varying]::text[])) AND (new.status::text = ANY (ARRAY['READY'::character varying, 'RUNNING'::character varying]::text[]))) OR new.status::text = 'BLOCKED'::text AND new.run_after < old.run_after)) EXECUTE FUNCTION tasks_concurrency_changed();

CREATE TRIGGER tasks_concurrency_updated_rows AFTER UPDATE ON tasks_task REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tasks_concurrency_after_update();

CREATE TRIGGER tasks_task_notify_finished AFTER UPDATE OF status ON tasks_task FOR EACH ROW WHEN (new.finish_waited AND (new.status::text = ANY (ARRAY['SUCCESSFUL'::character varying, 'FAILED'::character varying, 'CANCELLED'::character varying]::text[])) AND (old.status::text <> ALL (ARRAY['SUCCESSFUL'::character varying, 'FAILED'::character varying, 'CANCELLED'::character varying]::text[]))) EXECUTE FUNCTION tasks_task_notify_finished();

CREATE TRIGGER tasks_task_notify_insert AFTER INSERT ON tasks_task REFERENCING NEW TABLE AS inserted_rows FOR EACH STATEMENT EXECUTE FUNCTION tasks_task_notify_inserted();

CREATE TRIGGER tasks_task_notify_ready AFTER UPDATE OF status, run_after ON tasks_task FOR EACH ROW WHEN (new.status::text = 'READY'::text AND new.run_after <= statement_timestamp() AND (old.status::text <> 'READY'::text OR old.run_after > statement_timestamp())) EXECUTE FUNCTION tasks_task_notify_ready();

CREATE TRIGGER tasks_task_report_to_parent AFTER UPDATE ON tasks_task FOR EACH ROW WHEN (new.awaited_by IS NOT NULL AND (new.status::text = ANY (ARRAY['SUCCESSFUL'::character varying, 'FAILED'::character varying, 'CANCELLED'::character varying]::text[])) AND (old.status::text <> ALL (ARRAY['SUCCESSFUL'::character varying, 'FAILED'::character varying, 'CANCELLED'::character varying]::text[]))) EXECUTE FUNCTION tasks_report_to_parent();

CREATE TRIGGER tasks_workflow_mark AFTER UPDATE ON tasks_task FOR EACH ROW WHEN (new.workflow_id IS NOT NULL AND (old.status::text = ANY (ARRAY['SUCCESSFUL'::character varying, 'FAILED'::character varying, 'CANCELLED'::character varying]::text[])) IS DISTINCT FROM (new.status::text = ANY (ARRAY['SUCCESSFUL'::character varying, 'FAILED'::character varying, 'CANCELLED'::character varying]::text[])) AND set_config('leasing.workflow_settle'::text, (COALESCE(NULLIF(current_setting('leasing.workflow_settle'::text, true), ''::text), '0'::text)::integer + 1)::text, true) IS NULL) EXECUTE FUNCTION tasks_workflow_mark();

CREATE TRIGGER tasks_workflow_settle AFTER UPDATE ON tasks_task REFERENCING OLD TABLE AS old_rows NEW TABLE AS settled_rows FOR EACH STATEMENT WHEN (COALESCE(NULLIF(current_setting('leasing.workflow_settle'::text, true), ''::text), '0'::text) <> '0'::text) EXECUTE FUNCTION tasks_workflow_settle();

CREATE INDEX leasing_lease_expires_idx ON public.leasing_lease USING btree (expires_at);
CREATE INDEX leasing_lease_holder_d453b376 ON public.leasing_lease USING btree (holder);
CREATE INDEX leasing_lease_live_res_idx ON public.leasing_lease USING btree (resource) WHERE (released_at IS NULL);
CREATE UNIQUE INDEX leasing_lease_pkey ON public.leasing_lease USING btree (id);
CREATE INDEX leasing_lease_released_res_idx ON public.leasing_lease USING btree (resource) WHERE (released_at IS NOT NULL);
CREATE INDEX leasing_lease_resource_5aa0f567_like ON public.leasing_lease USING btree (resource varchar_pattern_ops);
CREATE UNIQUE INDEX leasing_lease_resource_key ON public.leasing_lease USING btree (resource);
CREATE UNIQUE INDEX tasks_activityhour_key ON public.tasks_activityhour USING btree (hour, queue, task_path);
CREATE UNIQUE INDEX tasks_activityhour_pkey ON public.tasks_activityhour USING btree (id);
CREATE UNIQUE INDEX tasks_activityhourmark_pkey ON public.tasks_activityhourmark USING btree (hour);
CREATE UNIQUE INDEX tasks_activityminute_pkey ON public.tasks_activityminute USING btree (minute);
CREATE UNIQUE INDEX tasks_archiveprogress_pkey ON public.tasks_archiveprogress USING btree (status);
CREATE INDEX tasks_archiveprogress_status_7d1536fc_like ON public.tasks_archiveprogress USING btree (status varchar_pattern_ops);
CREATE INDEX tasks_bulkop_finished_idx ON public.tasks_bulkoperation USING btree (finished_at, id) WHERE (finished_at IS NOT NULL);
CREATE INDEX tasks_bulkop_open_idx ON public.tasks_bulkoperation USING btree (id) WHERE ((status)::text = ANY ((ARRAY['PENDING'::character varying, 'RUNNING'::character varying])::text[]));
CREATE UNIQUE INDEX tasks_bulkoperation_pkey ON public.tasks_bulkoperation USING btree (id);
CREATE INDEX tasks_conchold_key_idx ON public.tasks_concurrencyhold USING btree (key);
CREATE INDEX tasks_conchold_worker_idx ON public.tasks_concurrencyhold USING btree (worker);
CREATE UNIQUE INDEX tasks_concurrencyhold_attempt ON public.tasks_concurrencyhold USING btree (task_id, token);
CREATE UNIQUE INDEX tasks_concurrencyhold_pkey ON public.tasks_concurrencyhold USING btree (id);
CREATE INDEX tasks_concurrencykey_idle_idx ON public.tasks_concurrencykey USING btree (updated_at);
CREATE INDEX tasks_concurrencykey_key_59bdeacc_like ON public.tasks_concurrencykey USING btree (key varchar_pattern_ops);
CREATE UNIQUE INDEX tasks_concurrencykey_pkey ON public.tasks_concurrencykey USING btree (key);
CREATE INDEX tasks_concurrencykey_wake_idx ON public.tasks_concurrencykey USING btree (wake_at) WHERE (wake_at IS NOT NULL);
CREATE INDEX tasks_concurrencywake_key_idx ON public.tasks_concurrencywake USING btree (key);
CREATE UNIQUE INDEX tasks_concurrencywake_pkey ON public.tasks_concurrencywake USING btree (id);
CREATE INDEX tasks_dependency_child_idx ON public.tasks_taskdependency USING btree (child_id, parent_id);
CREATE UNIQUE INDEX tasks_dependency_edge_uniq ON public.tasks_taskdependency USING btree (parent_id, child_id);
CREATE UNIQUE INDEX tasks_faircursor_pkey ON public.tasks_faircursor USING btree (queue);
CREATE INDEX tasks_faircursor_queue_d0b53e87_like ON public.tasks_faircursor USING btree (queue varchar_pattern_ops);
CREATE INDEX tasks_generatorstate_name_db9d4d36_like ON public.tasks_generatorstate USING btree (name varchar_pattern_ops);
CREATE UNIQUE INDEX tasks_generatorstate_pkey ON public.tasks_generatorstate USING btree (name);
CREATE INDEX tasks_queuecontrol_name_0be05bf0_like ON public.tasks_queuecontrol USING btree (name varchar_pattern_ops);
CREATE UNIQUE INDEX tasks_queuecontrol_pkey ON public.tasks_queuecontrol USING btree (name);
CREATE INDEX tasks_ratelimit_idle_idx ON public.tasks_ratelimit USING btree (decided_at);
CREATE INDEX tasks_ratelimit_key_8f422880_like ON public.tasks_ratelimit USING btree (key varchar_pattern_ops);
CREATE UNIQUE INDEX tasks_ratelimit_pkey ON public.tasks_ratelimit USING btree (key);
CREATE INDEX tasks_repair_kind_06de502b_like ON public.tasks_repair USING btree (kind varchar_pattern_ops);
CREATE UNIQUE INDEX tasks_repair_pkey ON public.tasks_repair USING btree (kind);
CREATE INDEX tasks_schedule_name_cbc36b77_like ON public.tasks_schedule USING btree (name varchar_pattern_ops);
CREATE UNIQUE INDEX tasks_schedule_pkey ON public.tasks_schedule USING btree (name);
CREATE UNIQUE INDEX tasks_schedulerun_pkey ON public.tasks_schedulerun USING btree (id);
CREATE INDEX tasks_schedulerun_prune_idx ON public.tasks_schedulerun USING btree (enqueued_at, id);
CREATE UNIQUE INDEX tasks_schedulerun_slot_uniq ON public.tasks_schedulerun USING btree (schedule, slot);
CREATE INDEX tasks_storedschedule_name_19c79b4c_like ON public.tasks_storedschedule USING btree (name varchar_pattern_ops);
CREATE UNIQUE INDEX tasks_storedschedule_pkey ON public.tasks_storedschedule USING btree (name);
CREATE INDEX tasks_task_blocked_idx ON public.tasks_task USING btree (concurrency_key, priority DESC, run_after, id) WHERE ((status)::text = 'BLOCKED'::text);
CREATE INDEX tasks_task_blocked_page_idx ON public.tasks_task USING btree (queue, status, id DESC) WHERE ((status)::text = 'BLOCKED'::text);
CREATE INDEX tasks_task_claim_idx ON public.tasks_task USING btree (queue, priority DESC, run_after, id, shared_crashes) WHERE ((status)::text = 'READY'::text);
CREATE UNIQUE INDEX tasks_task_debounce_waiting ON public.tasks_task USING btree (task_path, debounce_key) WHERE ((debounce_key IS NOT NULL) AND ((status)::text = ANY ((ARRAY['BLOCKED'::character varying, 'READY'::character varying])::text[])) AND (transitions = 0));
CREATE INDEX tasks_task_dedup_newest_idx ON public.tasks_task USING btree (dedup_key, status, id DESC) WHERE (dedup_key IS NOT NULL);
CREATE UNIQUE INDEX tasks_task_dedup_unfinished ON public.tasks_task USING btree (dedup_key) WHERE ((dedup_key IS NOT NULL) AND ((status)::text = ANY ((ARRAY['BLOCKED'::character varying, 'READY'::character varying, 'RUNNING'::character varying])::text[])));
CREATE INDEX tasks_task_fair_idx ON public.tasks_task USING btree (queue, fair_key, priority DESC, run_after, id) WHERE ((fair_key IS NOT NULL) AND ((status)::text = 'READY'::text));
CREATE INDEX tasks_task_holder_state_idx ON public.tasks_task USING btree (holder, status, id DESC) WHERE ((holder IS NOT NULL) AND (NOT ((status)::text = 'RUNNING'::text)));
CREATE INDEX tasks_task_isolation_idx ON public.tasks_task USING btree (queue, run_after) WHERE ((shared_crashes > 0) AND ((status)::text = 'READY'::text));
CREATE INDEX tasks_task_path_newest_idx ON public.tasks_task USING btree (task_path, status, id DESC) WHERE ((status)::text = ANY ((ARRAY['READY'::character varying, 'SUCCESSFUL'::character varying, 'FAILED'::character varying, 'CANCELLED'::character varying])::text[]));
CREATE UNIQUE INDEX tasks_task_pkey ON public.tasks_task USING btree (id);
CREATE INDEX tasks_task_prune_idx ON public.tasks_task USING btree (status, finished_at, id) WHERE (finished_at IS NOT NULL);
CREATE INDEX tasks_task_queue_newest_idx ON public.tasks_task USING btree (queue, status, id DESC) WHERE ((status)::text = ANY ((ARRAY['READY'::character varying, 'SUCCESSFUL'::character varying, 'FAILED'::character varying, 'CANCELLED'::character varying])::text[]));
CREATE INDEX tasks_task_rate_line_idx ON public.tasks_task USING btree (rate_key, run_after) WHERE ((rate_key IS NOT NULL) AND ((status)::text = ANY ((ARRAY['READY'::character varying, 'BLOCKED'::character varying])::text[])));
CREATE INDEX tasks_task_retry_idx ON public.tasks_task USING btree (id DESC) WHERE ((snoozed_at IS NULL) AND ((status)::text = 'READY'::text) AND ((failures > 0) OR (crashes > 0) OR (shared_crashes > 0)));
CREATE INDEX tasks_task_running_exp_idx ON public.tasks_task USING btree (expires_at) WHERE ((status)::text = 'RUNNING'::text);
CREATE INDEX tasks_task_running_unheld_idx ON public.tasks_task USING btree (id) WHERE ((holder IS NULL) AND ((status)::text = 'RUNNING'::text));
CREATE INDEX tasks_task_slot_idx ON public.tasks_task USING btree (concurrency_key) WHERE ((concurrency_key IS NOT NULL) AND ((status)::text = ANY ((ARRAY['READY'::character varying, 'RUNNING'::character varying])::text[])));
CREATE INDEX tasks_task_snoozed_idx ON public.tasks_task USING btree (id DESC) WHERE ((snoozed_at IS NOT NULL) AND ((status)::text = 'READY'::text));
CREATE INDEX tasks_task_state_idx ON public.tasks_task USING btree (status, id DESC) WHERE (NOT ((status)::text = 'RUNNING'::text));
CREATE INDEX tasks_task_stray_lease_idx ON public.tasks_task USING btree (id) WHERE ((expires_at IS NOT NULL) AND (released_at IS NULL) AND (NOT ((status)::text = 'RUNNING'::text)));
CREATE INDEX tasks_task_workflow_idx ON public.tasks_task USING btree (workflow_id, status, id DESC) WHERE (workflow_id IS NOT NULL);
CREATE UNIQUE INDEX tasks_taskdependency_pkey ON public.tasks_taskdependency USING btree (id);
CREATE INDEX tasks_taskevent_pending_idx ON public.tasks_taskevent USING btree (id) WHERE (NOT delivered);
CREATE UNIQUE INDEX tasks_taskevent_pkey ON public.tasks_taskevent USING btree (id);
CREATE UNIQUE INDEX tasks_taskevent_task_name ON public.tasks_taskevent USING btree (task_id, name);
CREATE UNIQUE INDEX tasks_taskstep_pkey ON public.tasks_taskstep USING btree (id);
CREATE UNIQUE INDEX tasks_taskstep_task_position ON public.tasks_taskstep USING btree (task_id, "position");
CREATE INDEX tasks_uniquekey_expires_idx ON public.tasks_uniquekey USING btree (expires_at, key);
CREATE INDEX tasks_uniquekey_key_b103762a_like ON public.tasks_uniquekey USING btree (key varchar_pattern_ops);
CREATE UNIQUE INDEX tasks_uniquekey_pkey ON public.tasks_uniquekey USING btree (key);
CREATE INDEX tasks_worker_id_bbed25e5_like ON public.tasks_worker USING btree (id varchar_pattern_ops);
CREATE INDEX tasks_worker_live_idx ON public.tasks_worker USING btree (last_seen_at) WHERE (stopped_at IS NULL);
CREATE UNIQUE INDEX tasks_worker_pkey ON public.tasks_worker USING btree (id);
CREATE INDEX tasks_worker_stopped_idx ON public.tasks_worker USING btree (stopped_at) WHERE (stopped_at IS NOT NULL);
CREATE UNIQUE INDEX tasks_workflow_pkey ON public.tasks_workflow USING btree (id);
CREATE INDEX tasks_workflow_prune_idx ON public.tasks_workflow USING btree (status, finished_at, id) WHERE (finished_at IS NOT NULL);
CREATE INDEX tasks_workflow_status_idx ON public.tasks_workflow USING btree (status, id DESC);
