-- tasks.web.argument_search: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: CREATE_INDEX_SQL
-- CONCURRENTLY: the table stays writable while the index is built (it is never done inside a
-- transaction, hence not in a migration: a migration runs in one). IF NOT EXISTS: a rerun is harmless.
-- A build that failed leaves an invalid index, which ``present`` does not count and ``drop`` removes.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON tasks_task USING gin ({column} jsonb_path_ops);

-- name: DROP_INDEX_SQL
-- The operator's removal of a search index: CONCURRENTLY, so writes go on meanwhile; IF EXISTS, so a
-- second drop (or one of an index never built) is harmless.
DROP INDEX CONCURRENTLY IF EXISTS {index};

-- name: PRESENT_SQL
-- Which of the indexes exist and are valid (a build interrupted leaves one invalid: the planner cannot use it).
SELECT c.relname FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE c.relname = ANY(%s) AND i.indisvalid AND i.indrelid = 'tasks_task'::regclass;
