"""A transactional test's teardown that empties only the tables the test wrote to.

Django's ``TransactionTestCase`` ends each test with ``manage.py flush``: one ``TRUNCATE`` of every
model's table (each given a new file, its indexes too) and then the ``post_migrate`` signal, which
rebuilds every content type and permission the truncate removed. On the test database that is some
sixty tables and a few hundred rows rebuilt, 0.45 s a test at the median on a two-core machine (383 s
of a 780 s database lane's teardowns), for tests that wrote to three or four tables.

Here one statement asks which of those tables hold a row, one ``TRUNCATE`` empties them, and the
content types and permissions (which no test changes: they follow the models) stay; should a test
have emptied them itself (a flush of its own, a migration backwards), ``post_migrate`` rebuilds them
as Django's teardown would. The state each test starts from is Django's: every model's table empty
but those two.
"""

from __future__ import annotations

from typing import Any

from django.core.management.sql import emit_post_migrate_signal
from django.db import connections
from django.test import TransactionTestCase

#: Tables the flush keeps: what ``post_migrate`` would write back at once.
KEPT = frozenset({"django_content_type", "auth_permission", "django_migrations"})

_django_fixture_teardown = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]
_statements: dict[tuple[str, tuple[str, ...]], str] = {}


def _which_hold_rows(alias: str, tables: tuple[str, ...]) -> str:
    """One statement naming each of ``tables`` that holds a row (an index probe each)."""
    key = (alias, tables)
    if key not in _statements:
        quote = connections[alias].ops.quote_name
        _statements[key] = " UNION ALL ".join(
            f"SELECT {i} WHERE EXISTS (SELECT FROM {quote(table)})" for i, table in enumerate(tables)
        )
    return _statements[key]


def empty_written_tables(alias: str) -> list[str]:
    """Empty every model table of ``alias`` that holds a row, but :data:`KEPT`; returns their names."""
    connection = connections[alias]
    names = connection.introspection.django_table_names(only_existing=True, include_views=False)
    tables = tuple(sorted(set(names) - KEPT))
    with connection.cursor() as cursor:
        cursor.execute(_which_hold_rows(alias, tables))
        written = [tables[i] for (i,) in cursor.fetchall()]
        if written:
            # CASCADE: a table that references one of them is a model table too (emptied by the flush).
            cursor.execute(f"TRUNCATE {', '.join(map(connection.ops.quote_name, written))} CASCADE")
        cursor.execute("SELECT EXISTS (SELECT FROM django_content_type)")
        (kept,) = cursor.fetchone()
    if not kept:
        emit_post_migrate_signal(verbosity=0, interactive=False, db=alias)
    return written


def _fixture_teardown(self: TransactionTestCase) -> Any:
    if self.available_apps is not None or self.serialized_rollback:
        return _django_fixture_teardown(self)
    for alias in self._databases_names(include_mirrors=False):  # type: ignore[attr-defined]
        empty_written_tables(alias)
    return None


def install() -> None:
    """Every transactional test of this run ends with :func:`_fixture_teardown` (tests/conftest.py)."""
    TransactionTestCase._fixture_teardown = _fixture_teardown  # type: ignore[attr-defined]
