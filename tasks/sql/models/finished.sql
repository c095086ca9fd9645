-- tasks.models.finished: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: FIND_FINISHED_SQL
SELECT * FROM tasks_finished WHERE id = %s LIMIT 1;

-- name: FINISHED_STATUS_SQL
SELECT status FROM tasks_finished WHERE id = %s LIMIT 1;

-- name: MOVED_IDS_SQL
-- Which of the ids a statement on tasks_task did not find were moved here (an error's message only:
-- no common path pays for it).
SELECT id, status FROM tasks_finished WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id;
