"""Fixtures shared by the database tests."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from tests.helpers import test_database_url as database_url  # not collected as a test


@pytest.fixture
def old_snapshot() -> Iterator[None]:
    """Another session holding a REPEATABLE READ snapshot (an analytics query, a forgotten
    transaction, pg_dump): no row version dead since it began can be removed, nor its index entries
    marked dead, for the test."""
    with psycopg.connect(database_url()) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM tasks_task").fetchone()
        yield
        holder.rollback()
