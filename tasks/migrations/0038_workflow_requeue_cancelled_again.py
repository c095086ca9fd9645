# A workflow member reopened and made final again in one statement (an operator's requeue of a
# dependant whose parent failed or was cancelled under on_failure="cancel": cancelled again at once) is
# counted once, as the net of both, by that statement's settle (issue 56). Before, the nested statement
# that cancelled it again counted it down first, from a count that did not have it yet (remaining never
# goes below 0), and the requeue's count-up then left the workflow RUNNING with every member final,
# until the repair sweep ended it. This migration carries its own text: the whole function as it
# stands after it (tasks/lifecycle/workflows.py says what each step does). Going back keeps this
# function: it runs on the schema of 0037 as well.

from django.db import migrations

SETTLE_SQL = r"""
CREATE OR REPLACE FUNCTION tasks_workflow_settle() RETURNS trigger LANGUAGE plpgsql AS $$
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
END $$;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0037_archive_progress"),
    ]

    operations = [
        migrations.RunSQL(SETTLE_SQL, migrations.RunSQL.noop),
    ]
