-- tasks.maintenance.partitions: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: PARTITIONS_SQL
-- Every partition of the status tables, with its bounds as PostgreSQL states them, its planner
-- estimate of rows (reltuples: -1 before the first VACUUM/ANALYZE) and its size with indexes and TOAST.
-- Catalog reads: the cost is the number of partitions, not of rows.
SELECT parent.relname, c.relname, pg_get_expr(c.relpartbound, c.oid), c.reltuples::bigint,
       pg_total_relation_size(c.oid), i.inhdetachpending
FROM unnest(%(parents)s::text[]) AS p(name)
JOIN pg_class AS parent ON parent.oid = to_regclass(p.name)
JOIN pg_inherits AS i ON i.inhparent = parent.oid
JOIN pg_class AS c ON c.oid = i.inhrelid;
