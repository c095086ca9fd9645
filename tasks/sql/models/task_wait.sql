-- tasks.models.task_wait: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: MARK_WAITED_SQL
-- : Marks the row waited for and reads its status (None: no such task where this connection looks).
UPDATE tasks_task SET finish_waited = true WHERE id = %s RETURNING status;

-- name: READ_STATUS_SQL
SELECT status FROM tasks_task WHERE id = %s;
