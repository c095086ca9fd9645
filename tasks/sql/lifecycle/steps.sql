-- tasks.lifecycle.steps: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: STEPS_READ_SQL
-- The stored steps of a task, in the order they ran: read once by each attempt, at its first step.
SELECT position, name, result::text, attempt FROM tasks_taskstep WHERE task_id = %(id)s ORDER BY position;

-- name: STEP_RECORD_SQL
-- The fence: a step's result, stored only while the attempt holds the task; the row's share lock is
-- held to the commit of the step's transaction. No row back: the attempt no longer holds the task and
-- the step's transaction must roll back.
INSERT INTO tasks_taskstep (task_id, position, name, attempt, token, result, started_at, completed_at)
SELECT t.id, %(position)s, %(name)s, %(attempt)s, t.token, %(result)s::jsonb, %(started_at)s, clock_timestamp()
FROM (
    SELECT id, token FROM tasks_task
    WHERE id = %(id)s AND holder = %(worker)s AND token = %(token)s AND status = 'RUNNING'
      AND expires_at > clock_timestamp()
    FOR SHARE
) AS t
RETURNING position;

-- name: SLEEP_WAKE_SQL
-- A durable sleep's wake time: the database clock plus the sleep (stored as the sleep's step).
SELECT clock_timestamp() + make_interval(secs => %(seconds)s);

-- name: SLEEP_REMAINING_SQL
-- The seconds left until a durable sleep's stored wake time, on the database clock (not above zero:
-- it has passed).
SELECT EXTRACT(EPOCH FROM (%(wake)s::timestamptz - clock_timestamp()))::float8;
