-- tasks.models.task_wait: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: MARK_WAITED_SQL
-- : Marks the row waited for and reads its status: (status, marked); no row: no such task where
-- : this connection looks. The mark never waits for a row lock (SKIP LOCKED): another transaction
-- : holding the row (a ``select_for_update()``, an operator's bulk action) would hold an UPDATE, and
-- : the wait with it, past its timeout. A row it could not mark is read all the same, and marked on a
-- : later read; until then its finish notifies nobody, so the wait polls.
WITH marked AS (
    UPDATE tasks_task SET finish_waited = true
    WHERE id = (SELECT id FROM tasks_task WHERE id = %(id)s FOR NO KEY UPDATE SKIP LOCKED)
    RETURNING status
)
SELECT COALESCE((SELECT status FROM marked), t.status), EXISTS (SELECT FROM marked)
FROM tasks_task AS t WHERE t.id = %(id)s;

-- name: READ_STATUS_SQL
-- A waiter's read once its wait is marked (finish_waited), after each notification or poll pause: the
-- status alone, by primary key.
SELECT status FROM tasks_task WHERE id = %s;
