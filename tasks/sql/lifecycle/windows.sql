-- tasks.lifecycle.windows: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: OPEN_WINDOW_SQL
-- A refused duplicate's answer: the task whose window is still open (a later statement, so a fresh
-- snapshot sees the window another transaction opened while the enqueue waited for its lock).
SELECT task_id FROM tasks_uniquekey WHERE key = %(key)s::text AND expires_at > clock_timestamp();

-- name: RELEASE_UNIQUE_KEY_SQL
-- ENQUEUE_UNIQUE_SQL took the key row but its insert met a plain dedup enqueue of the key that
-- committed meanwhile: give the window back (compare-and-set on the task it named, which does not
-- exist), so the key's next enqueue is judged as if this one had never come.
DELETE FROM tasks_uniquekey WHERE key = %(key)s::text AND task_id = %(task_id)s::bigint;
