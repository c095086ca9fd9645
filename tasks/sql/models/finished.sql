-- tasks.models.finished: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: FIND_FINISHED_SQL
-- A moved task read by id: the finished table's primary key (id) leads each partition's index, so one
-- probe per partition; LIMIT 1, the id is unique across them.
SELECT * FROM tasks_finished WHERE id = %s LIMIT 1;

-- name: FINISHED_STATUS_SQL
-- The same for its status alone (a waiter whose task the mover has taken).
SELECT status FROM tasks_finished WHERE id = %s LIMIT 1;

-- name: RESTORE_SQL
-- A moved task back into tasks_task, as it is (final: its status, attempts, result and errors kept),
-- for an operator's action that changes it: a rerun (the requeue that follows in the same transaction)
-- or a delete. One statement: the row leaves tasks_finished and arrives in tasks_task together (the
-- columns of both tables are in one order: a test holds them equal). An id not in tasks_finished
-- (never moved, restored already by another session: the DELETE waited for it and found it gone) is
-- left out of what it returns.
WITH back AS (DELETE FROM tasks_finished WHERE id = ANY(%(ids)s::bigint[]) RETURNING *)
INSERT INTO tasks_task SELECT * FROM back RETURNING id;

-- name: DELETE_ARCHIVED_SQL
-- An operator's delete of tasks kept in tasks_finished (the admin's delete of a moved task: history
-- that must go before its day does, say a customer's data). Its row is deleted from its day partition
-- (a dead tuple there until autovacuum or the day's retirement); an id not there is left out. Its
-- steps and events go with it (forget_steps_ctes); a restore or the mover keeps them (a move).
WITH deleted AS (DELETE FROM tasks_finished WHERE id = ANY(%(ids)s::bigint[]) RETURNING id),
gone_steps AS (
    DELETE FROM tasks_taskstep AS s WHERE s.task_id = ANY(ARRAY(SELECT deleted.id FROM deleted))
), gone_events AS (
    DELETE FROM tasks_taskevent AS e WHERE e.task_id = ANY(ARRAY(SELECT deleted.id FROM deleted))
)
SELECT id FROM deleted;

-- name: MOVED_IDS_SQL
-- Which of the ids a statement on tasks_task did not find were moved here (an error's message only:
-- no common path pays for it).
SELECT id, status FROM tasks_finished WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id;
