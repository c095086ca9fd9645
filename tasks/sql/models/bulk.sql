-- tasks.models.bulk: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: REQUEST_SQL
-- The operation's id range is fixed when it is requested: from before the oldest task to the newest
-- one, in tasks_task and, for a retry (the only kind that reaches the mover's rows: it brings them
-- back), in tasks_finished (probes of its primary keys, one per day kept there; a cancel or a discard
-- applies to waiting tasks and skips them: a one-time filter). Tasks enqueued afterwards are not its
-- business, and a retried task keeps its id, so no task is seen twice.
INSERT INTO tasks_bulkoperation
    (kind, filter, status, first_id, cursor, last_id, matched, changed, skipped, batches, requested_by,
     created_at, error)
SELECT %(kind)s, %(filter)s::jsonb, 'PENDING', first.id, first.id,
       COALESCE(GREATEST((SELECT max(id) FROM tasks_task),
                         (SELECT max(id) FROM tasks_finished WHERE %(kind)s = 'retry')), 0),
       0, 0, 0, 0, %(requested_by)s, clock_timestamp(), ''
FROM (SELECT COALESCE(LEAST((SELECT min(id) FROM tasks_task),
                            (SELECT min(id) FROM tasks_finished WHERE %(kind)s = 'retry')), 1) - 1 AS id)
     AS first
RETURNING id;

-- name: CANCEL_SQL
-- A cancel re-checks that the operation is still open on its newest version (a batch that finished it
-- meanwhile wins), and waits for a batch in flight (which holds the row) to commit first.
UPDATE tasks_bulkoperation SET status = 'CANCELLED', finished_at = clock_timestamp(), updated_at = clock_timestamp()
WHERE id = ANY(%(ids)s) AND status IN ('PENDING', 'RUNNING');
