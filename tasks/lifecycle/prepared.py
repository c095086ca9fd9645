"""The hot paths' statements, run as server-side prepared statements where the connection allows.

Django's PostgreSQL backend binds parameters on the client (psycopg's ``ClientCursor``): the server
parses, analyses and plans each statement text anew on every run. For the claim / finish / start /
heartbeat statements (CTEs over ~25 columns) and the enqueue's insert that is most of what the
database does per statement besides the commit (docs/explanation/benchmarks.md, "Prepared
statements"). Prepared once per connection, it is parsed and planned once.

A statement is prepared (psycopg's ``prepare=True``, on a server-binding cursor over Django's own
connection, inside Django's error wrapper) unless:

- the alias is in ``LEASING_TASKS["POOLED_DATABASES"]``: through a transaction pooler the next run
  may land on a server connection that never saw the statement (PgBouncer 1.21+ can track
  protocol-level prepared statements with ``max_prepared_statements``; declare the alias pooled
  unless it is configured so);
- the database's ``OPTIONS["prepare_threshold"]`` is set to ``None`` (the user turned psycopg's
  prepared statements off for that connection; Django's own default, the key absent, is not that);
- ``LEASING_TASKS["PREPARED_STATEMENTS"]`` is False;
- Django is recording queries (``DEBUG``, ``assertNumQueries``) or has an ``execute_wrapper`` of
  someone else's installed: those see every statement only through Django's cursor.

The worker's own bounds (leasing/bounds.py: statement and lock timeouts local to the statement's
transaction) are an execute wrapper too; they cannot ride in the same message as a prepared
statement, so here they go in the same *pipeline*: the ``set_config(…, true)`` SELECT and the prepared
statement are sent together with one Sync (one round trip), and the extended protocol runs every
statement before a Sync as one implicit transaction, so the local settings hold for the statement and
end with it, whatever a pooler does with the connection next.

Statements are named by their text and parameter types (``_dl_`` and a digest), not by psycopg's
per-connection counter (``_pg3_0``, ``_pg3_1``, ...). Through a transaction pooler nobody declared,
a counter name may already stand for another client's different statement on the server connection
the pooler picked, and the server would run that one (a plain insert for a dedup-keyed enqueue,
found by the breaker of issue 22). A name that is a digest of its text can only ever mean that
text: the server answers "prepared statement ... does not exist / already exists" instead. The
alias then stops preparing for the rest of the process (one warning), and a statement refused so
outside a transaction is run again unprepared (the refusal came before it ran). Inside the caller's
transaction the error is raised: that transaction is aborted, and the next one runs unprepared.

A statement that failed (a lock timeout, a value out of range) stays prepared and keeps its name:
psycopg's own bookkeeping forgets it and prepares it again under a new name, leaving one more
statement on the server per failure for the life of the connection. One whose result type a
migration changed ("cached plan must not change result type") is dropped with every other
prepared statement of the connection (DEALLOCATE ALL) and run again unprepared, outside a
transaction; it is prepared anew on its next run.

The naming and bookkeeping live in a subclass of psycopg's ``PrepareManager`` set on the connection
(psycopg 3.2 and 3.3 have the same one; ``tests/db/test_prepared.py`` fails if a later psycopg
changes it, and until then such a connection is simply not prepared on).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import psycopg
from django.conf import settings
from django.db.backends.base.base import BaseDatabaseWrapper
from psycopg.adapt import Dumper
from psycopg.pq import ExecStatus
from psycopg.types.datetime import TimestamptzLoader
from psycopg.types.string import StrDumper

try:
    from psycopg._preparing import Prepare, PrepareManager
except ImportError:  # pragma: no cover - a psycopg without them: nothing is prepared
    Prepare = PrepareManager = None  # type: ignore[assignment,misc]
try:
    from psycopg._queries import PostgresQuery, _query2pg_nocache

    # What _ConstantQuery below sets is what psycopg 3.2 and 3.3 set; a later psycopg that changed
    # them keeps its own conversion (tests/db/test_prepared.py fails, to say so).
    if not {"query", "_want_formats", "_order", "_parts", "_tx"} <= set(PostgresQuery.__slots__):
        raise ImportError("psycopg's PostgresQuery changed")
except ImportError:  # pragma: no cover - a psycopg without them: its own conversion, uncached
    PostgresQuery = _query2pg_nocache = None  # type: ignore[assignment,misc]

from leasing.bounds import LocalSettings
from tasks.conf import get_settings

logger = logging.getLogger("tasks.worker")

# Aliases where a prepared statement met a pooler: never prepared again in this process.
_refused: set[str] = set()
# psycopg prepares a statement run this many times unasked: never, here (only prepare=True does).
_ONLY_WHEN_ASKED = 2**62
_POOLER_ERRORS = (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)


_RESULT_TYPE_CHANGED = "cached plan must not change result type"


if PrepareManager is not None:

    class NamedByText(PrepareManager):
        """psycopg's prepared-statement bookkeeping, with names that say which statement they are
        and kept across a failed run (the module's docstring says why)."""

        def get(self, query: Any, prepare: bool | None = None) -> tuple[Any, bytes]:
            prep, name = super().get(query, prepare)
            if prep is Prepare.SHOULD:
                digest = hashlib.blake2b(query.query, digest_size=12)
                digest.update(repr(query.types).encode())
                name = b"_dl_" + digest.hexdigest().encode()
            return prep, name

        def validate(self, key: Any, prep: Any, name: bytes, results: Sequence[Any]) -> None:
            if self._should_discard(prep, results):
                return
            if prep is Prepare.SHOULD and any(r.status == ExecStatus.PIPELINE_ABORTED for r in results):
                # Sent in a pipeline whose earlier command failed (the bounds' SELECT, or the
                # prepare itself stopped by the lock timeout): the server never prepared it.
                self._names.pop(key, None)
                self._counts.pop(key, None)
                return
            self._rotate()  # psycopg forgets a statement whose run failed; it is still prepared


def _named_by_text(raw: psycopg.Connection[Any]) -> bool:
    """Give ``raw`` the bookkeeping above, unless it already prepares statements of its own
    (server-side binding with a prepare threshold: those keep psycopg's names)."""
    manager = getattr(raw, "_prepared", None)
    if PrepareManager is None or not isinstance(manager, PrepareManager):
        return False
    if isinstance(manager, NamedByText):
        return True
    if getattr(manager, "_names", None):
        return False
    named = NamedByText()
    named.prepare_threshold = manager.prepare_threshold
    named.prepared_max = manager.prepared_max
    raw._prepared = named
    return True


def preparable(connection: BaseDatabaseWrapper) -> bool:
    """Whether statements on ``connection`` run prepared (see the module's docstring)."""
    alias = connection.alias
    if alias in _refused or connection.queries_logged:
        return False
    if any(not isinstance(wrapper, LocalSettings) for wrapper in connection.execute_wrappers):
        return False
    conf = get_settings()
    if not conf.PREPARED_STATEMENTS or alias in conf.POOLED_DATABASES:
        return False
    options = connection.settings_dict.get("OPTIONS") or {}
    return not ("prepare_threshold" in options and options["prepare_threshold"] is None)


def rows(connection: BaseDatabaseWrapper, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run ``sql`` (``%(name)s`` placeholders) and return its rows (none for a statement without a
    result). A parameter that is None everywhere it appears needs a cast in the statement."""
    if preparable(connection):
        connection.ensure_connection()  # async_unsafe, as Django's own cursor() is
        connection.validate_no_broken_transaction()
        raw = connection.connection
        if _named_by_text(raw):
            # Django opens its connections with psycopg's preparing off (prepare_threshold None),
            # which psycopg honours even for prepare=True. Turned on for this statement only:
            # Django's own queries stay as they were (never prepared, not even counted).
            saved = raw.prepare_threshold
            raw.prepare_threshold = _ONLY_WHEN_ASKED if saved is None else saved
            try:
                with connection.wrap_database_errors:
                    return _run(raw, connection.execute_wrappers, sql, params)
            except Exception as exc:
                cause = exc.__cause__
                if isinstance(cause, _POOLER_ERRORS):
                    _refused.add(connection.alias)
                    raw._prepared.clear()  # DEALLOCATE ALL with the next statement
                    logger.warning(
                        "database %r refused a prepared statement (%s): a transaction pooler? Statements there "
                        "run unprepared from now on; list the alias in LEASING_TASKS['POOLED_DATABASES'] "
                        "(docs/howto/pgbouncer.md)",
                        connection.alias,
                        cause.sqlstate,
                    )
                elif isinstance(cause, psycopg.errors.FeatureNotSupported) and _RESULT_TYPE_CHANGED in str(cause):
                    raw._prepared.clear()  # prepared anew on the next run
                    logger.info("database %r: prepared statements dropped after a schema change", connection.alias)
                else:
                    raise
                if connection.in_atomic_block or not raw.autocommit:
                    raise
            finally:
                raw.prepare_threshold = saved
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


if PostgresQuery is not None:
    # psycopg turns ``%(name)s`` placeholders into ``$n`` with a regular expression over the whole
    # text, and caches the result only for texts of at most 4,096 bytes (an ORM's one-off INSERTs of
    # many rows would fill its cache). The claim statements are 5 to 7 KB: each run parsed its text
    # anew, 270 us of the dispatcher's thread per round. These are a few dozen constant texts.
    _converted = functools.lru_cache(maxsize=256)(_query2pg_nocache)

    class _ConstantQuery(PostgresQuery):
        """psycopg's query conversion, cached whatever the text's length."""

        def convert(self, query: Any, vars: Any) -> None:
            if vars is None or not isinstance(query, str):
                super().convert(query, vars)
                return
            encoding = self._tx.encoding
            self.query, self._want_formats, self._order, self._parts = _converted(query.encode(encoding), encoding)
            self.dump(vars)

    class _Cursor(psycopg.Cursor[Any]):
        _query_cls = _ConstantQuery

else:  # pragma: no cover
    _Cursor = psycopg.Cursor  # type: ignore[misc,assignment]


class _ArrayLiteral(str):
    """An array already written as PostgreSQL's text literal (``{1,2,3}``); its type is the class's."""

    __slots__ = ()


class _Int8Array(_ArrayLiteral):
    __slots__ = ()


class _Float8Array(_ArrayLiteral):
    __slots__ = ()


class _TextArray(_ArrayLiteral):
    __slots__ = ()


class _ArrayLiteralDumper(Dumper):
    def dump(self, obj: Any) -> bytes:
        return obj.encode()


class _Int8ArrayDumper(_ArrayLiteralDumper):
    oid = psycopg.postgres.types["int8"].array_oid


class _Float8ArrayDumper(_ArrayLiteralDumper):
    oid = psycopg.postgres.types["float8"].array_oid


class _TextArrayDumper(_ArrayLiteralDumper):
    oid = psycopg.postgres.types["text"].array_oid


_NONE = type(None)
_INFINITIES = (float("inf"), float("-inf"))


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _array(values: list[Any]) -> Any:
    """``values`` as an array literal when its elements are all ints, all floats (or None) or all
    strs (or None); anything else as it is, for psycopg to dump.

    psycopg's list dumper looks every element's type and dumper up and writes it in Python (15 % of
    the dispatcher's thread in a no-op drain: ids, tokens, return values, start times, positions:
    ten arrays a round). These three kinds are written here in one join. An int is sent as int8 and
    a float as float8 whatever its size (the statements cast each array to its column's type)."""
    if not values:
        return values
    kinds = {value.__class__ for value in values}
    if kinds == {int}:
        return _Int8Array("{" + ",".join(map(str, values)) + "}")
    if kinds == {str} or kinds == {str, _NONE}:
        return _TextArray("{" + ",".join("NULL" if v is None else _quoted(v) for v in values) + "}")
    if (kinds == {float} or kinds == {float, _NONE}) and not any(
        v is not None and (v != v or v in _INFINITIES) for v in values
    ):
        return _Float8Array("{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}")
    return values


def _cursor(raw: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    cursor = _Cursor(raw)
    cursor.adapters.register_dumper(_Int8Array, _Int8ArrayDumper)
    cursor.adapters.register_dumper(_Float8Array, _Float8ArrayDumper)
    cursor.adapters.register_dumper(_TextArray, _TextArrayDumper)
    # A str is sent as text (psycopg's default is "unknown", typed by the server from the context:
    # a parameter compared to a varchar column in one place and cast to text in another would be
    # two types, which the server refuses).
    cursor.adapters.register_dumper(str, StrDumper)
    if settings.USE_TZ:
        # Django's loader for timestamptz parses in psycopg's C code and then replaces the tzinfo with
        # Django's time zone in Python (1.7 us a value, against 0.5 us). With USE_TZ Django sets the
        # session's TimeZone to that same zone, in which psycopg's own loader returns the value: the
        # same instant in the same zone. A claimed row carries three or four of them.
        cursor.adapters.register_loader("timestamptz", TimestamptzLoader)
    return cursor


#: The statements run under a generic plan: planned once per connection, not on every run.
#:
#: PostgreSQL plans a prepared statement anew on each of its first five runs, then keeps its
#: generic plan only if that plan's estimated cost is no higher than the custom plans' average. For
#: the claim and round statements (CTEs over unnest() of array parameters, a LIMIT parameter) it
#: never is, so each run was planned again: 6-8 ms of planning a round on PostgreSQL 15 for 1-7 ms of
#: execution, idle polls included (docs/explanation/benchmarks.md, "Generic plans"). These are sent
#: after ``plan_cache_mode = force_generic_plan``, local to their own implicit transaction (the same
#: pipeline and Sync as the bounds above), so only when the connection is in autocommit, as a
#: worker's is: inside a caller's transaction the setting would hold to that transaction's end, for
#: the statements after it, so there they are planned as PostgreSQL chooses. The generic
#: plans read the same bounded index ranges as the custom ones: tests/db/test_generic_round_plans.py
#: runs each beside backlogs of 100,000 rows on every PostgreSQL major CI runs. Registered by the
#: modules that define the statements (:func:`plan_once`).
#:
#: The one plan is made on the table as it is when the connection first runs the statement, and kept
#: until the table's statistics change (autovacuum's ANALYZE). Made on a small table (a fresh
#: install, a truncated one, the quiet hour before a burst) it read the table whole: a sequential
#: scan, or a hash join over the whole primary key, to finish 16 tasks (1,700-11,400 blocks a round:
#: offered 4,000 tasks/s, one worker completed 1,683/s; docs/explanation/benchmarks.md, "Sustained
#: load against the peers"). So sequential scans are off for these statements too (local, like the plan
#: cache mode): every table the statements read is reached by a bounded index range, and each
#: statement names its rows' ids where the table meets an array parameter (``owned()`` in
#: tasks/lifecycle/fragments.py), so that the primary key is probed for them whatever the join.
#: Sorts and bitmap scans are off as well: on a table known to be empty whose indexes a burst had
#: grown (vacuumed in a quiet hour), with the statistics of an earlier backlog, the planner priced a
#: bitmap of every READY row, filtered and sorted, below the claim index's ordered walk, and each
#: round read 50,000-100,000 blocks to claim two tasks until the next ANALYZE. The claim index is the
#: one path to a queue's priorities and due rows in order, so with sorts off (a penalty, not a ban:
#: the sorts no index can give stay in every plan alike) it is the path chosen, whatever the
#: statistics said when the plan was made. Before PostgreSQL 18 a node turned off is priced 1e10 more,
#: so every plan that keeps such a sort costs past the JIT thresholds: JIT is off with them (as in
#: leasing/bounds.py), else PostgreSQL 15 compiled the several-queues claim and the rounds on each run
#: (1-2 s a claim, for 5 ms of execution).
#: tests/db/test_generic_round_plans.py makes the plans on such an empty table and runs them beside
#: the backlogs.
GENERIC_PLAN: set[str] = set()
GENERIC_PLAN_SETTINGS = (
    "SELECT set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true),"
    " set_config('enable_sort', 'off', true), set_config('enable_bitmapscan', 'off', true),"
    " set_config('jit', 'off', true)"
)


def plan_once(*texts: str) -> None:
    """Run ``texts`` (when prepared) under one generic plan per connection (:data:`GENERIC_PLAN`)."""
    GENERIC_PLAN.update(texts)


def _run(raw: psycopg.Connection[Any], wrappers: list[Any], sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    params = {name: _array(value) if value.__class__ is list else value for name, value in params.items()}
    generic = raw.autocommit and sql in GENERIC_PLAN  # never past a statement: not in a caller's transaction
    with _cursor(raw) as cursor:
        if not wrappers and not generic:
            cursor.execute(sql, params, prepare=True)
            return _fetched(cursor)
        with raw.pipeline():
            for wrapper in wrappers:
                cursor.execute(wrapper.prefix, prepare=True)
            if generic:
                cursor.execute(GENERIC_PLAN_SETTINGS, prepare=True)
            cursor.execute(sql, params, prepare=True)
        # After the pipeline's one Sync: the cursor holds every statement's result, the last one ours.
        while cursor.nextset():
            pass
        return _fetched(cursor)


def _fetched(cursor: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
    # Not ``cursor.description``: it builds a Column object per result column on every call (22 of
    # them for a claim), only to be tested for emptiness.
    result = cursor.pgresult
    return cursor.fetchall() if result is not None and result.status == ExecStatus.TUPLES_OK else []
