"""The database's own functions that move tasks (the concurrency triggers and the admission the
migrations create) are named in the state machine's table, and the table names none that is gone."""

from __future__ import annotations

import re

import pytest
from django.db import connection

from tasks.lifecycle import transitions

pytestmark = pytest.mark.django_db

# A function body moves a task when it updates tasks_task's status or assigns NEW.status.
_MOVES = re.compile(r"UPDATE\s+tasks_task\b(?!_)(\s+AS\s+\w+)?\s+SET\s+(\w+\.)?status\s*=|NEW\.status\s*:=", re.I)


def _functions() -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT p.proname, p.prosrc FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace"
            " WHERE n.nspname = current_schema() AND p.proname LIKE 'tasks\\_%%'"
        )
        return dict(cursor.fetchall())


def test_every_database_function_that_moves_a_task_is_in_the_table():
    functions = _functions()
    assert "tasks_concurrency_admit" in functions  # the query sees the migrations' functions at all
    moving = {f"db:{name}" for name, body in functions.items() if _MOVES.search(body)}
    named = {name for name in transitions.statements() if name.startswith("db:")}
    assert moving == named, (
        f"move tasks but unnamed: {sorted(moving - named)}; named but not moving: {sorted(named - moving)}"
    )
