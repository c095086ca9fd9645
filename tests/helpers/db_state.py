"""Every row the application writes, for "a rejected request changes nothing" checks."""

from __future__ import annotations

from typing import Any

from django.db import connection

TABLES = ("tasks_task", "leasing_lease", "tasks_worker", "tasks_generatorstate")


def database_state() -> dict[str, list[tuple[Any, ...]]]:
    """All rows of the application's tables, every column, in primary-key order. Reading them also
    proves psycopg can decode every stored value (a year-10000 timestamp would raise here)."""
    state: dict[str, list[tuple[Any, ...]]] = {}
    with connection.cursor() as cursor:
        for table in TABLES:
            cursor.execute(f"SELECT * FROM {table} ORDER BY 1")
            state[table] = cursor.fetchall()
    return state
