from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connections

from tasks.management.commands._common import database_alias
from tasks.web.argument_search import CREATE_INDEX_SQL, DROP_INDEX_SQL, INDEXES, present


class Command(BaseCommand):
    help = (
        "Create, drop or show the opt-in GIN indexes (jsonb_path_ops) that serve searching tasks by their"
        " arguments (kwargs:{...}, args:[...]) on the dashboard and in the admin. Built CONCURRENTLY: the"
        " table stays writable meanwhile. Each enqueue then also writes the index (docs/howto/operations.md)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["create", "drop", "status"])
        parser.add_argument(
            "--column", choices=sorted(INDEXES), action="append", help="kwargs and/or args (default: both)"
        )
        parser.add_argument("--database", type=database_alias, default="default", help="the database alias")

    def handle(self, *, action: str, column: list[str] | None, database: str, **options: Any) -> None:
        columns = column or sorted(INDEXES)
        if action != "status":
            statement = CREATE_INDEX_SQL if action == "create" else DROP_INDEX_SQL
            connection = connections[database]
            connection.ensure_connection()
            for name in columns:
                # CONCURRENTLY cannot run inside a transaction: each in autocommit, one at a time.
                with connection.cursor() as cursor:
                    # An invalid index left by an interrupted build is dropped first (IF NOT EXISTS would keep it).
                    if action == "create" and name not in present(database):
                        cursor.execute(DROP_INDEX_SQL.format(index=INDEXES[name]))
                    cursor.execute(statement.format(index=INDEXES[name], column=name))
        found = present(database)
        for name in sorted(INDEXES):
            state = "present" if name in found else "absent"
            self.stdout.write(f"{name}: {INDEXES[name]} {state}")
