-- tasks.maintenance.partitions: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: PARTITIONS_SQL
-- Every partition of the status tables, with its bounds as PostgreSQL states them, its planner
-- estimate of rows (reltuples: -1 before the first VACUUM/ANALYZE) and its size with indexes and TOAST.
-- Catalog reads: the cost is the number of partitions, not of rows. No lock on a partition being
-- detached: a DETACH ... FINALIZE holds it (ACCESS EXCLUSIVE) while it waits for every older snapshot,
-- this statement's among them, so a read waiting for it would wait for itself ("deadlock detected",
-- once the other snapshots end). So its size is not read (pg_total_relation_size locks), and bounds
-- are deparsed with no relation (0: pg_get_expr locks the one named; a bound names no column).
SELECT parent.relname, c.relname, pg_get_expr(c.relpartbound, 0), c.reltuples::bigint,
       CASE WHEN NOT i.inhdetachpending THEN pg_total_relation_size(c.oid) END, i.inhdetachpending
FROM unnest(%(parents)s::text[]) AS p(name)
JOIN pg_class AS parent ON parent.oid = to_regclass(p.name)
JOIN pg_inherits AS i ON i.inhparent = parent.oid
JOIN pg_class AS c ON c.oid = i.inhrelid;

-- name: FORGET_DAY_STEPS_SQL
-- The steps and events of a retired day's tasks (issue 58), deleted before its table is dropped: a
-- batch of the table's ids after the last one done, through its primary key (id leads it), and their
-- rows through the steps' and events' unique indexes (forget_steps_ctes). Run on the detached table
-- (it takes no new row: the mover cannot move into a day no longer attached), each batch its own
-- statement; a retirement interrupted between batches or before its DROP leaves the table, and the
-- next one (FINALIZE, or the drop of a detached table) does the day again from its first id.
-- ``{table}``: the day's table, named by this module (_NAME), quoted by the caller.
WITH picked AS MATERIALIZED (
    SELECT d.id FROM "{table}" AS d WHERE d.id > %(after)s ORDER BY d.id LIMIT %(limit)s
), gone_steps AS (
    DELETE FROM tasks_taskstep AS s WHERE s.task_id = ANY(ARRAY(SELECT picked.id FROM picked))
), gone_events AS (
    DELETE FROM tasks_taskevent AS e WHERE e.task_id = ANY(ARRAY(SELECT picked.id FROM picked))
)
SELECT max(id), count(*) FROM picked;
