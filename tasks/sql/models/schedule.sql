-- tasks.models.schedule: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: STORED_CREATE_SQL
-- A new schedule; no row when the name is taken (the caller answers 409).
INSERT INTO tasks_storedschedule AS s (
    name, entry, paused, revision, effective_from, created_at, updated_at, changed_by)
VALUES (%(name)s, %(entry)s::jsonb, %(paused)s, nextval('tasks_storedschedule_revision_seq'), clock_timestamp(), clock_timestamp(),
        clock_timestamp(), %(by)s)
ON CONFLICT (name) DO NOTHING
RETURNING name, entry, paused, revision, effective_from, created_at, updated_at;

-- name: STORED_REPLACE_SQL
-- Replace the definition: compare-and-set on the revision the caller read and validated against
-- (no row: deleted, or edited meanwhile; the caller answers 404 or 409). The timing restarts now.
UPDATE tasks_storedschedule AS s SET
    entry = %(entry)s::jsonb, paused = %(paused)s, revision = nextval('tasks_storedschedule_revision_seq'),
    effective_from = clock_timestamp(), updated_at = clock_timestamp(), changed_by = %(by)s
WHERE s.name = %(name)s AND s.revision = %(revision)s
RETURNING name, entry, paused, revision, effective_from, created_at, updated_at;

-- name: STORED_PAUSE_SQL
-- Pause: the scheduler enqueues nothing for it from its next statement on. Already paused: no change.
UPDATE tasks_storedschedule AS s SET
    paused = true, revision = nextval('tasks_storedschedule_revision_seq'), updated_at = clock_timestamp(),
    changed_by = %(by)s
WHERE s.name = %(name)s AND NOT s.paused
RETURNING name, entry, paused, revision, effective_from, created_at, updated_at;

-- name: STORED_RESUME_SQL
-- Resume: slots after now run, the ones missed while paused do not. Not paused: no change.
UPDATE tasks_storedschedule AS s SET
    paused = false, revision = nextval('tasks_storedschedule_revision_seq'), effective_from = clock_timestamp(),
    updated_at = clock_timestamp(),
    changed_by = %(by)s
WHERE s.name = %(name)s AND s.paused
RETURNING name, entry, paused, revision, effective_from, created_at, updated_at;

-- name: STORED_DELETE_SQL
-- Delete: the progress row and the runs stay (history; runs are pruned by age as any others).
DELETE FROM tasks_storedschedule AS s WHERE s.name = %(name)s
RETURNING name, entry, paused, revision, effective_from, created_at, updated_at;
