-- tasks.lifecycle.operations: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: DELETE_FINISHED_SQL
-- An operator's delete (the admin; TaskQuerySet.delete_finished): the rows named go only if every one
-- of them is finished. One that is not (a RUNNING attempt, a task still waiting) refuses the whole
-- delete and changes nothing (invariant 12): no transition deletes an unfinished row, whose worker, key
-- slot or dependants would wait for it. ``picked`` locks the rows first, in id order (FOR UPDATE: a
-- requeue or claim committing meanwhile is read as it committed), so the check and the DELETE see the
-- same statuses; the refused rows come back with their statuses, for the message. The deleted tasks'
-- steps and events go with them (forget_steps_ctes).
WITH picked AS MATERIALIZED (
    SELECT t.id, t.status FROM tasks_task AS t
    WHERE t.id = ANY(%(ids)s::bigint[])
    ORDER BY t.id
    FOR UPDATE
), deleted AS (
    DELETE FROM tasks_task AS t USING picked AS p
    WHERE t.id = p.id
      AND NOT EXISTS (SELECT 1 FROM picked AS u WHERE u.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))
    RETURNING t.id
), gone_steps AS (
    DELETE FROM tasks_taskstep AS s WHERE s.task_id = ANY(ARRAY(SELECT deleted.id FROM deleted))
), gone_events AS (
    DELETE FROM tasks_taskevent AS e WHERE e.task_id = ANY(ARRAY(SELECT deleted.id FROM deleted))
)
SELECT true, id, NULL::text FROM deleted
UNION ALL
SELECT false, id, status FROM picked WHERE status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED');
