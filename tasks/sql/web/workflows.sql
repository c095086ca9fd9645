-- tasks.web.workflows: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: WORKFLOW_COUNTS_SQL
-- Per status, the workflows counted up to a cap from tasks_workflow_status_idx (status, id DESC), read
-- in its own order over the status alone (as tasks/web/queries.py counts tasks): a range closed on both
-- sides, not an equality, so no other index gives the order and the plan cannot be a backward scan of
-- the primary key filtering on the status (after a burst of newer workflows of other statuses it would
-- step over the whole burst). A status reads its own entries, at most ``limit``: counting the running
-- workflows costs the running ones, whatever history lies beside them.
SELECT s.status,
       (SELECT count(*) FROM (SELECT 1 FROM tasks_workflow AS w WHERE w.status >= s.status AND w.status <= s.status
                              ORDER BY w.status, w.id DESC LIMIT %(limit)s) AS n)
FROM unnest(%(statuses)s::text[]) AS s(status);
