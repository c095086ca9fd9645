"""A repair in a test is a failure (DESIGN.md invariant 14, issue 56).

The repair sweep (tasks/maintenance/repair.py) sets right a workflow or a dependant that a settle
should have settled; it counts each repair in ``tasks_repair``, and every repair is a bug report.
After each test that reached the database, and before its teardown empties or rolls back what it
wrote, this plugin reads ``tasks_repair``: a row there fails the test at its teardown, naming the
kinds and the last task repaired, unless the test is marked ``@pytest.mark.repairs`` (it strands a
member or a workflow on purpose, to prove the sweep).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

#: The fixtures through which a test reaches the database (as pytest-django names them).
_DATABASE_FIXTURES = frozenset({"db", "transactional_db", "live_server", "django_db_reset_sequences"})

_READ_SQL = """
SELECT kind, count, last_task_id FROM tasks_repair WHERE count > 0 ORDER BY kind
"""


def _reached_the_database(item: pytest.Item) -> bool:
    return item.get_closest_marker("django_db") is not None or bool(
        _DATABASE_FIXTURES & set(getattr(item, "fixturenames", ()))
    )


def _repairs() -> list[tuple[str, int, int | None]]:
    """The repairs counted in the default database, or none when it cannot be read (the test left its
    connection in a failed transaction, or migrated backwards past ``tasks_repair``)."""
    from django.db import DatabaseError, connection

    if connection.needs_rollback:
        return []
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regclass('tasks_repair') IS NOT NULL")
            if not cursor.fetchone()[0]:
                return []
            cursor.execute(_READ_SQL)
            return [(kind, count, last) for kind, count, last in cursor.fetchall()]
    except DatabaseError:
        return []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    found: list[tuple[str, int, int | None]] = []
    if _reached_the_database(item) and item.get_closest_marker("repairs") is None:
        from pytest_django.plugin import blocking_manager_key

        with item.config.stash[blocking_manager_key].unblock():
            found = _repairs()
    result = yield
    if found:
        kinds = ", ".join(f"{kind} x{count} (last task {last})" for kind, count, last in found)
        raise AssertionError(
            f"the repair sweep repaired {kinds} during {item.nodeid}: a settle left a workflow or a "
            "dependant stranded (tasks/maintenance/repair.py). Mark the test @pytest.mark.repairs only "
            "if it strands one on purpose."
        )
    return result
