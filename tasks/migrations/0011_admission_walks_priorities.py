# The admission of a concurrency key picks its due waiting tasks in claim order (priority DESC, run_after,
# id) through tasks_task_blocked_idx (concurrency_key, priority DESC, run_after, id) WHERE status =
# 'BLOCKED'. Two things made it read every deferred waiting task of the key (a retry backing off waits
# BLOCKED, so there can be many): ``run_after <= clock_timestamp()`` is volatile, so it was checked on
# each heap row instead of bounding the index scan; and one ordered scan meets a higher priority's
# deferred rows before a lower priority's due ones (PostgreSQL 18's skip scan jumps over them, 13-17
# have none). The clock is now read once, just before the pick, into ``due_by`` (a value the index
# can use), and the pick walks the key's priorities itself, as the claim does (tasks/lifecycle/statements.py,
# _PICK_ONE, says why and what it costs); still one ARRAY(...) InitPlan, run once (0010). Only that
# statement of the function and its new variable change; the rest is 0009's text. Each way the function
# is written out whole: a migration carries the text it runs and imports no other (tasks/sql/schema.sql
# shows what is live now).

from django.db import migrations

# 0010's function, its pick walking the key's priorities from a clock read once (due_by).
FORWARD_SQL = """\
CREATE OR REPLACE FUNCTION tasks_concurrency_admit(k text, lim integer, sets_limit boolean) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    cap integer;
    held integer;
    admitted integer;
    due_by timestamptz;
    previous_timeout text := current_setting('lock_timeout');
BEGIN
    -- The key's row lock serialises admissions (held until the transaction ends). ON CONFLICT DO
    -- UPDATE locks and returns the row's latest version. The wait is bounded: a transaction that
    -- enqueued a task of this key and has not committed yet (an application's long transaction)
    -- holds the lock, and a worker's finishing statement must not wait for it. Giving up here admits
    -- nothing now; the recovery round's sweep (tasks/lifecycle/concurrency.py) admits for the key later.
    -- (The block is a subtransaction: a timeout rolls the setting back with it.)
    BEGIN
        PERFORM set_config('lock_timeout', '200ms', true);
        INSERT INTO tasks_concurrencykey AS c (key, max_running, updated_at)
        VALUES (k, COALESCE(lim, (SELECT concurrency_limit FROM tasks_task
                                  WHERE status = 'BLOCKED' AND concurrency_key = k LIMIT 1), 1), clock_timestamp())
        ON CONFLICT (key) DO UPDATE SET
            max_running = CASE WHEN sets_limit THEN EXCLUDED.max_running ELSE c.max_running END,
            updated_at = CASE WHEN sets_limit THEN EXCLUDED.updated_at ELSE c.updated_at END
        RETURNING c.max_running INTO cap;
        PERFORM set_config('lock_timeout', previous_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        RETURN 0;
    END;
    -- A new snapshot (each query of a VOLATILE function takes one): what holds the key's slots now.
    SELECT count(*) INTO held FROM tasks_task WHERE concurrency_key = k AND status IN ('READY', 'RUNNING');
    IF held >= cap THEN
        RETURN 0;
    END IF;
    PERFORM set_config('leasing.concurrency_admitting', k, true);
    -- SKIP LOCKED: a blocked row locked by someone else is being cancelled, deleted or edited;
    -- waiting for it could deadlock (they wait for this key's lock). The next admission, or the
    -- recovery round, takes it if it is still blocked.
    due_by := clock_timestamp();
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
    RETURN admitted;
END $$;"""

# Back to the function as 0010 left it.
BACKWARD_SQL = """\
CREATE OR REPLACE FUNCTION tasks_concurrency_admit(k text, lim integer, sets_limit boolean) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    cap integer;
    held integer;
    admitted integer;
    previous_timeout text := current_setting('lock_timeout');
BEGIN
    -- The key's row lock serialises admissions (held until the transaction ends). ON CONFLICT DO
    -- UPDATE locks and returns the row's latest version. The wait is bounded: a transaction that
    -- enqueued a task of this key and has not committed yet (an application's long transaction)
    -- holds the lock, and a worker's finishing statement must not wait for it. Giving up here admits
    -- nothing now; the recovery round's sweep (tasks/lifecycle/concurrency.py) admits for the key later.
    -- (The block is a subtransaction: a timeout rolls the setting back with it.)
    BEGIN
        PERFORM set_config('lock_timeout', '200ms', true);
        INSERT INTO tasks_concurrencykey AS c (key, max_running, updated_at)
        VALUES (k, COALESCE(lim, (SELECT concurrency_limit FROM tasks_task
                                  WHERE status = 'BLOCKED' AND concurrency_key = k LIMIT 1), 1), clock_timestamp())
        ON CONFLICT (key) DO UPDATE SET
            max_running = CASE WHEN sets_limit THEN EXCLUDED.max_running ELSE c.max_running END,
            updated_at = CASE WHEN sets_limit THEN EXCLUDED.updated_at ELSE c.updated_at END
        RETURNING c.max_running INTO cap;
        PERFORM set_config('lock_timeout', previous_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        RETURN 0;
    END;
    -- A new snapshot (each query of a VOLATILE function takes one): what holds the key's slots now.
    SELECT count(*) INTO held FROM tasks_task WHERE concurrency_key = k AND status IN ('READY', 'RUNNING');
    IF held >= cap THEN
        RETURN 0;
    END IF;
    PERFORM set_config('leasing.concurrency_admitting', k, true);
    -- SKIP LOCKED: a blocked row locked by someone else is being cancelled, deleted or edited;
    -- waiting for it could deadlock (they wait for this key's lock). The next admission, or the
    -- recovery round, takes it if it is still blocked.
    UPDATE tasks_task AS t SET status = 'READY'
    WHERE t.id = ANY(ARRAY(
        SELECT id FROM tasks_task
        WHERE status = 'BLOCKED' AND concurrency_key = k AND run_after <= clock_timestamp()
        ORDER BY priority DESC, run_after, id
        LIMIT cap - held
        FOR UPDATE SKIP LOCKED
    ));
    GET DIAGNOSTICS admitted = ROW_COUNT;
    PERFORM set_config('leasing.concurrency_admitting', '', true);
    RETURN admitted;
END $$;"""


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0010_admission_picks_once"),
    ]

    operations = [migrations.RunSQL(FORWARD_SQL, BACKWARD_SQL)]
