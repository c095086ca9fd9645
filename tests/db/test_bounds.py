"""Statement and lock timeouts set per transaction (leasing/bounds.py), never as session state."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from leasing.bounds import StatementBounds, bound, unbound
from tests.testapp.models import Gate

pytestmark = pytest.mark.django_db(transaction=True)


def session_settings(wrapper: BaseDatabaseWrapper) -> tuple[str, str]:
    """The session's own values, read on the raw connection (past the execute wrappers)."""
    row = wrapper.connection.execute(
        "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')"
    ).fetchone()
    return row[0], row[1]


@pytest.fixture(params=["client-side binding", "server-side binding"])
def bounded(request: pytest.FixtureRequest) -> Iterator[BaseDatabaseWrapper]:
    """A connection of its own, bounded at 200 ms, with Django's default cursor or server-side binding
    (whose extended protocol takes one statement per message)."""
    settings_dict = copy.deepcopy(connection.settings_dict)
    if request.param == "server-side binding":
        settings_dict["OPTIONS"] = {**settings_dict.get("OPTIONS", {}), "server_side_binding": True}
    wrapper = connections["default"].__class__(settings_dict, alias="bounded")
    bound(wrapper, statement_ms=200, lock_ms=200)
    wrapper.ensure_connection()
    yield wrapper
    wrapper.close()


def test_a_slow_statement_is_cancelled_and_nothing_stays_on_the_session(bounded: BaseDatabaseWrapper) -> None:
    with pytest.raises(OperationalError, match="statement timeout"), bounded.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(2)")
    assert session_settings(bounded) == ("0", "0")


def test_a_lock_wait_ends_at_the_lock_timeout(bounded: BaseDatabaseWrapper) -> None:
    bound(bounded, statement_ms=5000, lock_ms=100)
    gate = Gate.objects.create(key="locked")
    with transaction.atomic():
        Gate.objects.select_for_update().get(pk=gate.pk)  # held by the test's own connection
        with pytest.raises(OperationalError, match="lock timeout"), bounded.cursor() as cursor:
            cursor.execute("UPDATE testapp_gate SET open = true WHERE id = %s", [gate.pk])
    assert session_settings(bounded) == ("0", "0")


def test_results_and_row_counts_are_the_statements_own(bounded: BaseDatabaseWrapper) -> None:
    Gate.objects.bulk_create([Gate(key=f"g{n}") for n in range(3)])
    with bounded.cursor() as cursor:
        cursor.execute("UPDATE testapp_gate SET open = true WHERE key IN (%s, %s) RETURNING key", ["g0", "g2"])
        assert cursor.rowcount == 2
        assert sorted(row[0] for row in cursor.fetchall()) == ["g0", "g2"]
        cursor.execute("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')")
        assert cursor.fetchone() == ("200ms", "200ms")  # in force for the statement itself
        cursor.executemany("INSERT INTO testapp_gate (key, open) VALUES (%s, false)", [("m1",), ("m2",)])
    assert Gate.objects.filter(key__in=["m1", "m2"]).count() == 2
    assert session_settings(bounded) == ("0", "0")


def test_inside_a_transaction_the_bounds_hold_to_its_end_and_no_further(bounded: BaseDatabaseWrapper) -> None:
    bounded.set_autocommit(False)
    with bounded.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert session_settings(bounded) == ("200ms", "200ms")  # local to this transaction
    bounded.commit()
    bounded.set_autocommit(True)
    assert session_settings(bounded) == ("0", "0")


def test_bound_again_changes_the_bounds_in_place() -> None:
    wrapper = connections["default"]
    try:
        first = bound(wrapper, statement_ms=100, lock_ms=50)
        second = bound(wrapper, statement_ms=300, lock_ms=150)
        assert first is second
        assert [w for w in wrapper.execute_wrappers if isinstance(w, StatementBounds)] == [first]
        with wrapper.cursor() as cursor:
            cursor.execute("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')")
            assert cursor.fetchone() == ("300ms", "150ms")
    finally:
        unbound(wrapper)
    assert not [w for w in wrapper.execute_wrappers if isinstance(w, StatementBounds)]
    with pytest.raises(ValueError, match="at least 1 ms"):
        StatementBounds(statement_ms=0, lock_ms=10)
