"""Statement and lock timeouts for the project's own connections, set per transaction.

A worker's dispatcher, a lease heartbeat or a release after a loss must never hang on a row lock or
a stalled server, so their statements carry a ``statement_timeout`` and a ``lock_timeout``. Those used
to be set once per connection with ``set_config(…, false)``: session state. Behind a transaction
pooler (PgBouncer, ``pool_mode = transaction``) a session is not ours: the setting landed on whichever
server connection served that statement and stayed there for the web requests served next (they
read back ``statement_timeout = 1s``).

So the bounds go with each statement instead: :class:`StatementBounds` is an execute wrapper that
sends ``SELECT set_config(…, true), set_config(…, true); <statement>`` as one query message. One round
trip, as before; PostgreSQL runs the messages's statements as one implicit transaction, ``true`` makes
both settings local to it, and since PostgreSQL 13 the statement timeout is armed per statement of a
message, with the value in force when that statement starts. Inside an explicit transaction the same
prefix sets them for the rest of that transaction. Nothing outlives the transaction, whatever the
pooler does with the server connection next.

Two consequences of the prefix. A statement PostgreSQL refuses inside a transaction block (VACUUM,
CREATE/DROP INDEX CONCURRENTLY, CREATE DATABASE) fails on a bounded connection, since the prefix makes
its message a multi-statement one; none of the project's bounded connections (a worker's dispatcher
and heartbeat, lease heartbeats and releases) sends one, and retention and migrations run unbounded.
And in an aborted transaction, which takes nothing but ROLLBACK (TO SAVEPOINT), no prefix is sent.

The same prefix turns JIT compilation off for the statement (``jit = off``, local too), and
:func:`without_jit` sends only that part for the dashboard's, the API's and the scrape's statements.
Every statement of this project reads a bounded range of an index (docs/explanation/benchmarks.md), so JIT can
only cost: PostgreSQL decides to compile from the plan's *estimated* cost, and a loose index scan's
estimate (a recursive CTE of ``LIMIT 1`` probes) can be millions where the work is four buffers.
Debian's and most managed servers ship JIT on (the embedded server is built without it): on
PostgreSQL 15 the dashboard's key and queue summaries spent 700 ms and 370 ms compiling and 0.2 ms
running, so the overview and /metrics took 1.1 s at a million tasks against 95 ms at ten thousand.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import psycopg
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from psycopg.pq import TransactionStatus

_NO_JIT = "set_config('jit', 'off', true)"
_PREFIX = (
    "SELECT set_config('statement_timeout', '{statement}ms', true), set_config('lock_timeout', '{lock}ms', true), "
    + _NO_JIT
)


class LocalSettings:
    """An execute wrapper (``connection.execute_wrappers``) sending ``prefix`` (a SELECT of
    ``set_config(…, true)`` calls) with every statement it sees, local to that statement's transaction."""

    prefix = "SELECT " + _NO_JIT

    def __call__(self, execute: Any, sql: Any, params: Any, many: bool, context: dict[str, Any]) -> Any:
        cursor = context["cursor"].cursor  # psycopg's own cursor under Django's wrapper
        if cursor.connection.info.transaction_status == TransactionStatus.INERROR:
            # An aborted transaction takes nothing but ROLLBACK (TO SAVEPOINT): a prefix there would
            # fail and take the rollback down with it (a failed inner atomic block, get_or_create's
            # race), leaving the whole transaction to roll back. Nothing is bounded there anyway.
            return execute(sql, params, many, context)
        if many or not isinstance(cursor, psycopg.ClientCursor):
            # One statement per message here (executemany, or server-side binding: the extended
            # protocol takes no second statement): the bounds go first, in the caller's transaction,
            # or in one of their own opened for this statement.
            wrapper: BaseDatabaseWrapper = context["connection"]
            if wrapper.get_autocommit():
                with wrapper.connection.transaction():
                    cursor.execute(self.prefix)
                    return execute(sql, params, many, context)
            cursor.execute(self.prefix)
            return execute(sql, params, many, context)
        # Client-side binding (Django's default): one message, one round trip.
        result = execute(f"{self.prefix}; {sql}", params, many, context)
        # The cursor stands on the first result (the prefix's row): step to the caller's statement,
        # whose rows, description and rowcount Django reads next.
        cursor.nextset()
        return result


class StatementBounds(LocalSettings):
    """Bounds every statement it sees: statement and lock timeouts (and no JIT)."""

    def __init__(self, *, statement_ms: int, lock_ms: int) -> None:
        self.set(statement_ms=statement_ms, lock_ms=lock_ms)

    def set(self, *, statement_ms: int, lock_ms: int) -> None:
        # Whole numbers written into the text: no parameter, so the prefix never shifts the caller's.
        self.statement_ms, self.lock_ms = int(statement_ms), int(lock_ms)
        if self.statement_ms < 1 or self.lock_ms < 1:
            raise ValueError("statement and lock timeouts must be at least 1 ms (0 would mean none)")
        self.prefix = _PREFIX.format(statement=self.statement_ms, lock=self.lock_ms)


class NoJit(LocalSettings):
    """Turns JIT compilation off for every statement it sees (the module docstring says why)."""


@contextmanager
def without_jit() -> Iterator[None]:
    """Within the block, this thread's statements on every database go without JIT compilation
    (a page or a scrape may read several databases)."""
    with ExitStack() as stack:
        for connection in connections.all(initialized_only=False):
            stack.enter_context(connection.execute_wrapper(NoJit()))
        yield


def bound(connection: BaseDatabaseWrapper, *, statement_ms: int, lock_ms: int) -> StatementBounds:
    """Bound every later statement ``connection`` (one thread's wrapper) sends; calling it again
    changes the bounds in place. The wrapper outlives reconnects, so a new server connection is
    bounded from its first statement."""
    for wrapper in connection.execute_wrappers:
        if isinstance(wrapper, StatementBounds):
            wrapper.set(statement_ms=statement_ms, lock_ms=lock_ms)
            return wrapper
    bounds = StatementBounds(statement_ms=statement_ms, lock_ms=lock_ms)
    connection.execute_wrappers.append(bounds)
    return bounds


def unbound(connection: BaseDatabaseWrapper) -> None:
    """Take the bounds off ``connection`` again (a worker run in a caller's thread, when it stops)."""
    connection.execute_wrappers[:] = [w for w in connection.execute_wrappers if not isinstance(w, StatementBounds)]
