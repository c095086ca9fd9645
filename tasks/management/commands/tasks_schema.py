"""The functions, triggers and indexes of tasks and leasing as a migrated database holds them: printed, written to
tasks/sql/schema.sql, or checked against it; with --write, also every statement constant as the text
that runs (tasks/management/sql_files.py: tasks/sql/<package>/<module>.sql, leasing/sql/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from tasks.management import sql_files
from tasks.management.commands._common import database_alias
from tasks.web.argument_search import INDEXES as SEARCH_INDEXES

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "sql" / "schema.sql"
REGENERATE = "python manage.py tasks_schema --write"

HEADER = f"""\
-- The functions, triggers and indexes of django-leasing (the tasks and leasing apps) as they stand after
-- every migration, each kind ordered by name: the text PostgreSQL runs. Generated from a migrated database
-- (pg_get_functiondef, pg_get_triggerdef, pg_get_indexdef; the opt-in argument-search indexes of
-- `manage.py tasks_search_index` are not among them); do not edit. Change a migration, migrate, then
-- regenerate:
--     {REGENERATE}
-- tests/db/test_schema_sql.py fails while this file and a migrated database differ.
"""

# A function is the apps' when it carries their prefix or one of their tables' triggers runs it; a
# trigger when it is on one of their tables (internal ones, of foreign keys, are not ours to show).
# to_regclass(): a table not created yet is NULL, not an error (--check on a database not migrated).
FUNCTIONS_SQL = """
SELECT pg_get_functiondef(p.oid)
FROM pg_proc AS p
WHERE p.pronamespace = current_schema()::regnamespace
  AND (p.proname ~ '^(tasks|leasing)_'
       OR p.oid IN (SELECT t.tgfoid FROM pg_trigger AS t
                    WHERE t.tgrelid IN (SELECT to_regclass(name) FROM unnest(%(tables)s::text[]) AS name)))
ORDER BY p.proname, pg_get_function_identity_arguments(p.oid)
"""
TRIGGERS_SQL = """
SELECT pg_get_triggerdef(t.oid, true)
FROM pg_trigger AS t
WHERE t.tgrelid IN (SELECT to_regclass(name) FROM unnest(%(tables)s::text[]) AS name) AND NOT t.tgisinternal
ORDER BY t.tgname, t.tgrelid::regclass::text
"""

# Every index of their tables (primary keys and unique constraints included) but the opt-in ones.
INDEXES_SQL = """
SELECT pg_get_indexdef(i.indexrelid)
FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid IN (SELECT to_regclass(name) FROM unnest(%(tables)s::text[]) AS name)
  AND NOT c.relname = ANY(%(opt_in)s::text[])
ORDER BY c.relname
"""


def render_schema(connection: BaseDatabaseWrapper) -> str:
    tables = [model._meta.db_table for app in ("tasks", "leasing") for model in apps.get_app_config(app).get_models()]
    with connection.cursor() as cursor:
        cursor.execute(FUNCTIONS_SQL, {"tables": tables})
        functions = [f"{definition.rstrip()};\n" for (definition,) in cursor.fetchall()]
        cursor.execute(TRIGGERS_SQL, {"tables": tables})
        triggers = [f"{definition};\n" for (definition,) in cursor.fetchall()]
        cursor.execute(INDEXES_SQL, {"tables": tables, "opt_in": sorted(SEARCH_INDEXES.values())})
        indexes = "".join(f"{definition};\n" for (definition,) in cursor.fetchall())
    return "\n".join([HEADER, *functions, *triggers, indexes])


class Command(BaseCommand):
    help = (
        "Print the functions and triggers of tasks and leasing as the database holds them (pg_get_functiondef,"
        f" pg_get_triggerdef); --write them to {SCHEMA_FILE.name} in the package (a checkout), --check that it"
        " holds them: the database is migrated as this version ships."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument("--write", action="store_true", help=f"write {SCHEMA_FILE} and the statement files beside it")
        mode.add_argument("--check", action="store_true", help=f"exit 1 when {SCHEMA_FILE.name} differs")
        parser.add_argument("--database", type=database_alias, default="default", help="the database alias")

    def handle(self, *, write: bool, check: bool, database: str, **options: Any) -> None:
        text = render_schema(connections[database])
        if write:
            SCHEMA_FILE.write_text(text)
            self.stdout.write(f"wrote {SCHEMA_FILE}")
            statements = sql_files.render()
            for path in sql_files.stale(statements):
                path.unlink()
                self.stdout.write(f"removed {path} (no module defines its statements any more)")
            for path, body in statements.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists() or path.read_text() != body:
                    path.write_text(body)
                    self.stdout.write(f"wrote {path}")
        elif check:
            if SCHEMA_FILE.read_text() != text:
                raise CommandError(
                    f"{SCHEMA_FILE} and database {database!r} differ: migrate the database, or, if the"
                    f" migrations changed, regenerate the file: {REGENERATE}"
                )
            self.stdout.write(f"{SCHEMA_FILE.name} matches database {database!r}")
        else:
            self.stdout.write(text, ending="")
