-- tasks.models.finished: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: FIND_FINISHED_SQL
SELECT * FROM tasks_finished WHERE id = %s LIMIT 1;

-- name: FINISHED_STATUS_SQL
SELECT status FROM tasks_finished WHERE id = %s LIMIT 1;
