"""leasing/bounds.py: a bounded connection inside transactions, savepoints and
multi-result messages, on a real server.

Found by a bug hunt (breaker) on issue 19: bounded connections behind PgBouncer."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
from django.db import IntegrityError, InternalError, connection, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from leasing.bounds import bound
from tests.testapp.models import Gate

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["client-side binding", "server-side binding"])
def bounded_as_default(request: pytest.FixtureRequest) -> Iterator[BaseDatabaseWrapper]:
    settings_dict = copy.deepcopy(connection.settings_dict)
    if request.param == "server-side binding":
        settings_dict["OPTIONS"] = {**settings_dict.get("OPTIONS", {}), "server_side_binding": True}
    wrapper = connections["default"].__class__(settings_dict, alias="default")
    bound(wrapper, statement_ms=2000, lock_ms=2000)
    wrapper.ensure_connection()
    yield wrapper
    wrapper.close()


def test_a_failed_savepoint_rolls_back_and_the_transaction_goes_on(bounded_as_default: BaseDatabaseWrapper) -> None:
    """An inner atomic block that fails (get_or_create's race, an IntegrityError caught) rolls back to
    its savepoint; the outer transaction goes on and commits. The savepoint rollback is sent in an
    aborted transaction, where PostgreSQL takes nothing but ROLLBACK (TO SAVEPOINT): no prefix there."""
    Gate.objects.create(key="taken")
    original = connections["default"]
    connections["default"] = bounded_as_default
    try:  # this thread's "default" is the bounded connection for the block
        with transaction.atomic():
            Gate.objects.create(key="before")
            try:
                with transaction.atomic():
                    Gate.objects.create(key="taken")  # unique: IntegrityError, savepoint rolled back
            except IntegrityError:
                pass
            Gate.objects.create(key="after")
            with bounded_as_default.cursor() as cursor:
                cursor.execute("SELECT current_setting('statement_timeout')")
                assert cursor.fetchone() == ("2s",)
    finally:
        connections["default"] = original
    assert set(Gate.objects.values_list("key", flat=True)) == {"taken", "before", "after"}


def test_row_counts_descriptions_and_errors_are_the_callers_statements(
    bounded_as_default: BaseDatabaseWrapper,
) -> None:
    """What Django reads after a statement (rowcount for update()/delete(), description, the error)
    belongs to the caller's statement, never to the prefix's one-row SELECT."""
    Gate.objects.bulk_create([Gate(key=f"r{n}") for n in range(5)])
    with bounded_as_default.cursor() as cursor:
        cursor.execute("UPDATE testapp_gate SET open = true WHERE key LIKE %s", ["r%"])
        assert cursor.rowcount == 5
        assert cursor.description is None
        cursor.execute("DELETE FROM testapp_gate WHERE key IN (%s, %s)", ["r0", "r1"])
        assert cursor.rowcount == 2
        cursor.execute("SELECT key FROM testapp_gate WHERE false")
        assert cursor.rowcount == 0
        assert cursor.fetchall() == []
        assert cursor.description is not None
        assert [column.name for column in cursor.description] == ["key"]
        cursor.execute("SELECT 1 -- a trailing comment")
        assert cursor.fetchone() == (1,)
        with pytest.raises(IntegrityError):
            cursor.execute("INSERT INTO testapp_gate (key, open) VALUES (%s, false)", ["r2"])
        cursor.execute("SELECT count(*) FROM testapp_gate")  # the autocommit connection goes on
        assert cursor.fetchone() == (3,)


def test_a_queryset_iterator_on_a_bounded_connection(bounded_as_default: BaseDatabaseWrapper) -> None:
    """QuerySet.iterator() uses a named server-side cursor (DECLARE ... WITH HOLD in autocommit): the
    bounds must not take its place or close it before its rows are read."""
    Gate.objects.bulk_create([Gate(key=f"i{n}") for n in range(5)])
    original = connections["default"]
    connections["default"] = bounded_as_default
    try:
        keys = [gate.key for gate in Gate.objects.order_by("key").iterator(chunk_size=2)]
        with transaction.atomic():
            in_atomic = [gate.key for gate in Gate.objects.order_by("key").iterator(chunk_size=2)]
    finally:
        connections["default"] = original
    assert keys == in_atomic == [f"i{n}" for n in range(5)]


def test_a_statement_refused_in_a_transaction_block_fails_on_a_bounded_connection(
    bounded_as_default: BaseDatabaseWrapper,
) -> None:
    """The documented limit of the prefix (leasing/bounds.py): VACUUM and the CONCURRENTLY forms fail
    there, so none of the project's bounded connections may send one."""
    with (
        pytest.raises(InternalError, match="cannot run inside a transaction block"),
        bounded_as_default.cursor() as cursor,
    ):
        cursor.execute("VACUUM testapp_gate")
    with bounded_as_default.cursor() as cursor:  # the connection goes on
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)
