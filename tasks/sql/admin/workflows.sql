-- tasks.admin.workflows: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: NAME_SEARCH_SQL
-- The newest NAME_WINDOW workflows, read backwards from the primary key, then matched on the name:
-- the derived table's LIMIT bounds the read whatever the planner thinks of the name's selectivity.
SELECT w.id FROM (SELECT id, name FROM tasks_workflow ORDER BY id DESC LIMIT %(window)s) AS w WHERE w.name = %(name)s;
