"""Retention: delete finished tasks, ended leases, stopped workers, old schedule runs and the windows
of unique keys that passed.

Each delete is one short statement over at most ``batch`` rows, picked oldest first through an
index and locked with ``FOR UPDATE SKIP LOCKED``: no long lock is held, a row another session is
changing right now is passed over (the next pass gets it), and the worker's hot path never waits
for the pruner. A batch resumes from the last key the previous batch deleted, so a pass over a
million rows does not step again over the index entries of the rows it has just deleted.

What can never be deleted, whatever the settings or the command line say:

- an unfinished task (BLOCKED, READY or RUNNING): the statement picks rows of one *finished* status, and the
  row lock re-checks that status on the row's newest version (PostgreSQL re-evaluates a locking
  query's WHERE on a row changed concurrently), so a task requeued while the pruner looked at it is
  left alone;
- a live lease: only leases that ended (released, or expired) before the cutoff are picked; a lease
  re-acquired meanwhile has a future ``expires_at`` on its newest version and is passed over;
- a worker row that still holds a running task (crash attribution reads it).

Fencing tokens need no row to keep growing: every grant draws from the one sequence
``leasing_fence_token_seq``, so a lease recreated after its row was pruned gets a larger token than
any before it.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from leasing.bounds import without_jit
from tasks.conf import DEFAULT_RETENTION, get_settings
from tasks.lifecycle.steps import forget_steps_ctes
from tasks.lifecycle.workflows import PRUNE_WORKFLOWS_SQL

logger = logging.getLogger("tasks.retention")

FINISHED_STATUSES = ("SUCCESSFUL", "FAILED", "CANCELLED")
#: Everything retention knows how to prune, in the order a pass goes through them.
KINDS = (*FINISHED_STATUSES, "LEASES", "WORKERS", "SCHEDULE_RUNS", "UNIQUE_KEYS", "BULK_OPERATIONS")
assert set(KINDS) == set(DEFAULT_RETENTION)

_UNITS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_BEGINNING = dt.datetime(1, 1, 1, tzinfo=dt.timezone.utc)


def parse_duration(value: Any) -> dt.timedelta:
    """A retention age: seconds (int or float), a timedelta, or text such as "7d", "12h", "1d12h",
    "90m", "30s", "2w". Never negative."""
    if isinstance(value, dt.timedelta):
        result = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        result = dt.timedelta(seconds=value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text and text.replace(".", "", 1).isdigit():
            result = dt.timedelta(seconds=float(text))
        else:
            parts = _PART.findall(text)
            if not parts or "".join(number + unit for number, unit in parts) != text:
                raise ValueError(f"{value!r} is not a duration: use e.g. 7d, 12h, 1d12h, 90m, 30s or seconds")
            result = dt.timedelta(seconds=sum(float(number) * _UNITS[unit] for number, unit in parts))
    else:
        raise ValueError(f"{value!r} is not a duration: use e.g. 7d, 12h, 90m, 30s or a number of seconds")
    if result < dt.timedelta(0):
        raise ValueError(f"a retention age cannot be negative, got {value!r}")
    return result


def retention_policy(setting: Any = ...) -> dict[str, dt.timedelta | None] | None:
    """The ages of ``LEASING_TASKS["RETENTION"]`` per kind (None: kept forever); None when the
    setting is None (no automatic pruning). Raises ValueError naming the bad key."""
    if setting is ...:
        setting = get_settings().RETENTION
    if setting is None:
        return None
    if not isinstance(setting, dict):
        raise ValueError('LEASING_TASKS["RETENTION"] must be a dict of durations (or None)')
    unknown = sorted(set(setting) - set(KINDS))
    if unknown:
        raise ValueError(f'unknown LEASING_TASKS["RETENTION"] keys: {", ".join(unknown)} (known: {", ".join(KINDS)})')
    policy: dict[str, dt.timedelta | None] = {}
    for kind in KINDS:
        value = setting.get(kind, DEFAULT_RETENTION[kind])
        try:
            policy[kind] = None if value is None else parse_duration(value)
        except ValueError as exc:
            raise ValueError(f'LEASING_TASKS["RETENTION"]["{kind}"]: {exc}') from None
    return policy


# -- statements ----------------------------------------------------------------------------------
#
# One shape for every kind: pick the oldest ``limit`` rows past the cutoff after the cursor (the
# last (time, id) deleted), lock them skipping locked ones, delete them, return their keys. The
# database clock decides the cutoff, read once per statement: ``statement_timestamp()`` is stable,
# so the cutoff bounds the index scan (``clock_timestamp()``, volatile, would be a filter, and the
# last batch of a pass would walk every row still kept).


def _prune_sql(table: str, at: str, condition: str) -> str:
    # MATERIALIZED: the pick runs once (tasks/lifecycle/claim.py, PICK_ONE, says why).
    return f"""
WITH picked AS MATERIALIZED (
    SELECT id FROM {table} AS candidate
    WHERE {condition}
      AND {at} < statement_timestamp() - make_interval(secs => %(age)s)
      AND ({at}, id) > (%(after_at)s, %(after_id)s)
    ORDER BY {at}, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {table} AS doomed
USING picked
WHERE doomed.id = picked.id
RETURNING doomed.{at}, doomed.id
"""


# Finished tasks of one status (and optionally one queue), through tasks_task_prune_idx
# (status, finished_at, id) WHERE finished_at IS NOT NULL: an exact range scan of that status. Their
# steps and events go in the same statement (forget_steps_ctes).
PRUNE_TASKS_SQL = f"""
WITH picked AS MATERIALIZED (
    SELECT id FROM tasks_task AS candidate
    WHERE status = %(status)s AND finished_at IS NOT NULL AND workflow_id IS NULL
      AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
      AND finished_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (finished_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY finished_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM tasks_task AS doomed
    USING picked
    WHERE doomed.id = picked.id
    RETURNING doomed.finished_at, doomed.id
), {forget_steps_ctes("deleted")}
SELECT finished_at, id FROM deleted
"""
# Workflow members are pruned with their workflow, as one unit, once the workflow is finished and
# older than its status's age (tasks/lifecycle/workflows.py, PRUNE_WORKFLOWS_SQL).

# Leases that ended (released: expires_at was set to the release time; or expired) before the
# cutoff, through leasing_lease_expires_idx. A live lease has expires_at in the future.
PRUNE_LEASES_SQL = _prune_sql("leasing_lease", "expires_at", "true")

# Workers that stopped (cleanly, or recorded dead by recovery) before the cutoff and hold no
# running task, through tasks_worker_stopped_idx.
PRUNE_WORKERS_SQL = _prune_sql(
    "tasks_worker",
    "stopped_at",
    "stopped_at IS NOT NULL AND NOT EXISTS ("
    "SELECT 1 FROM tasks_task AS t WHERE t.status = 'RUNNING' AND t.holder = candidate.id)",
)

# Enqueued slots of periodic tasks (the schedule row keeps the newest), through
# tasks_schedulerun_prune_idx (enqueued_at, id).
PRUNE_SCHEDULE_RUNS_SQL = _prune_sql("tasks_schedulerun", "enqueued_at", "true")

# Windows of unique keys (tasks/lifecycle/windows.py) that passed before the cutoff, through
# tasks_uniquekey_expires_idx (expires_at, key). An open window has expires_at in the future, and a
# window reopened meanwhile has it on its newest version, which the row lock re-checks.
PRUNE_UNIQUE_KEYS_SQL = """
WITH picked AS MATERIALIZED (
    SELECT key FROM tasks_uniquekey
    WHERE expires_at < statement_timestamp() - make_interval(secs => %(age)s)
      AND (expires_at, key) > (%(after_at)s, %(after_id)s::text)
    ORDER BY expires_at, key
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM tasks_uniquekey AS doomed
USING picked
WHERE doomed.key = picked.key
RETURNING doomed.expires_at, doomed.key
"""

# Bulk operations that ended (done, cancelled or failed: each sets finished_at as it ends; an open one
# has none) before the cutoff, through tasks_bulkop_finished_idx (finished_at, id). An operator reading
# one as it goes is not in the way: a delete takes no lock a reader waits for.
PRUNE_BULK_OPERATIONS_SQL = _prune_sql(
    "tasks_bulkoperation", "finished_at", "finished_at IS NOT NULL AND status IN ('DONE', 'CANCELLED', 'FAILED')"
)


# The safety net under the deletes that take a task's steps and events with it (issue 58): steps and
# events whose task is in neither tasks_task nor tasks_finished (orphaned before those deletes did, or
# by a hand edit). A batch: the next ``limit`` task ids after the cursor, read in order from the
# table's unique index (task_id leads it: the scan stops at the limit-th id, reading those tasks' rows
# only), looked up by primary key in tasks_task and in tasks_finished (its day partitions' keys, id
# first) as one array each (an InitPlan: a probe per id whatever the tables' sizes, never a scan of
# every task); the orphans' rows go through the same index. One statement, one snapshot: a move or a
# restore is one statement too, so a task is seen in one table or the other, never in neither.
def _orphans_sql(table: str) -> str:
    return f"""
WITH picked AS MATERIALIZED (
    SELECT DISTINCT o.task_id FROM {table} AS o
    WHERE o.task_id > %(after)s
    ORDER BY o.task_id
    LIMIT %(limit)s
), kept AS MATERIALIZED (
    SELECT t.id FROM tasks_task AS t WHERE t.id = ANY(ARRAY(SELECT picked.task_id FROM picked))
    UNION ALL
    SELECT f.id FROM tasks_finished AS f WHERE f.id = ANY(ARRAY(SELECT picked.task_id FROM picked))
), orphaned AS MATERIALIZED (
    SELECT p.task_id FROM picked AS p WHERE NOT EXISTS (SELECT FROM kept WHERE kept.id = p.task_id)
), gone AS (
    DELETE FROM {table} AS o WHERE o.task_id = ANY(ARRAY(SELECT orphaned.task_id FROM orphaned))
    RETURNING 1
)
SELECT (SELECT max(task_id) FROM picked), (SELECT count(*) FROM picked), (SELECT count(*) FROM gone)
"""


# Steps and events whose task is in neither tasks_task nor tasks_finished: a batch of task ids after
# the cursor, each probed by primary key in both tables (_orphans_sql), per statement.
ORPHANS_SQL = {"steps": _orphans_sql("tasks_taskstep"), "events": _orphans_sql("tasks_taskevent")}

_STATEMENTS = {
    **dict.fromkeys(FINISHED_STATUSES, PRUNE_TASKS_SQL),
    "LEASES": PRUNE_LEASES_SQL,
    "WORKERS": PRUNE_WORKERS_SQL,
    "SCHEDULE_RUNS": PRUNE_SCHEDULE_RUNS_SQL,
    "UNIQUE_KEYS": PRUNE_UNIQUE_KEYS_SQL,
    "BULK_OPERATIONS": PRUNE_BULK_OPERATIONS_SQL,
}

# What a prune would delete (``--dry-run``), through the same indexes.
_COUNT_SQL = {
    "TASKS": "SELECT count(*) FROM tasks_task WHERE status = %(status)s AND finished_at IS NOT NULL"
    " AND workflow_id IS NULL AND finished_at < statement_timestamp() - make_interval(secs => %(age)s)"
    " AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)",
    "LEASES": "SELECT count(*) FROM leasing_lease"
    " WHERE expires_at < statement_timestamp() - make_interval(secs => %(age)s)",
    "WORKERS": "SELECT count(*) FROM tasks_worker AS candidate WHERE stopped_at IS NOT NULL"
    " AND stopped_at < statement_timestamp() - make_interval(secs => %(age)s) AND NOT EXISTS ("
    "SELECT 1 FROM tasks_task AS t WHERE t.status = 'RUNNING' AND t.holder = candidate.id)",
    "SCHEDULE_RUNS": "SELECT count(*) FROM tasks_schedulerun"
    " WHERE enqueued_at < statement_timestamp() - make_interval(secs => %(age)s)",
    "UNIQUE_KEYS": "SELECT count(*) FROM tasks_uniquekey"
    " WHERE expires_at < statement_timestamp() - make_interval(secs => %(age)s)",
    "BULK_OPERATIONS": "SELECT count(*) FROM tasks_bulkoperation WHERE finished_at IS NOT NULL"
    " AND status IN ('DONE', 'CANCELLED', 'FAILED')"
    " AND finished_at < statement_timestamp() - make_interval(secs => %(age)s)",
}


@dataclass
class Batch:
    """What one statement deleted."""

    kind: str
    deleted: int
    seconds: float


@dataclass
class PruneCursor:
    """Where a pass over one kind stands: the last (time, id) deleted."""

    kind: str
    age: dt.timedelta
    #: Before every row at first (a worker's id is text: "" sorts first).
    after: tuple[dt.datetime, Any] = (_BEGINNING, 0)
    deleted: int = 0
    done: bool = False
    #: A finished status's pass prunes plain tasks, then the workflows that ended in that status
    #: with their members (``stage`` "workflows", from ``workflows_after``).
    stage: str = "tasks"
    workflows_after: tuple[dt.datetime, int] = (_BEGINNING, 0)

    def __post_init__(self) -> None:
        if self.kind in ("WORKERS", "UNIQUE_KEYS") and self.after == (_BEGINNING, 0):
            self.after = (_BEGINNING, "")


def prune_batch(cursor: PruneCursor, *, limit: int, queue: str | None = None, using: str = DEFAULT_DB_ALIAS) -> Batch:
    """Delete one batch of ``cursor.kind`` (one statement, its own transaction in autocommit)."""
    if cursor.stage == "workflows":
        return _prune_workflows_batch(cursor, limit=limit, using=using)
    params = {
        "status": cursor.kind,
        "queue": queue,
        "age": cursor.age.total_seconds(),
        "after_at": cursor.after[0],
        "after_id": cursor.after[1],
        "limit": limit,
    }
    started = time.perf_counter()
    with without_jit(), connections[using].cursor() as db:
        db.execute(_STATEMENTS[cursor.kind], params)
        rows = db.fetchall()
    if rows:
        cursor.after = max(rows)
        cursor.deleted += len(rows)
    # Fewer than asked: the range up to the cutoff is exhausted (rows skipped because another
    # session held them locked are picked up by the next pass).
    cursor.done = len(rows) < limit
    if cursor.done and cursor.kind in FINISHED_STATUSES and queue is None:
        cursor.stage, cursor.done = "workflows", False
    return Batch(cursor.kind, len(rows), time.perf_counter() - started)


def _prune_workflows_batch(cursor: PruneCursor, *, limit: int, using: str) -> Batch:
    """Finished workflows of ``cursor.kind``'s status, with their members: ``deleted`` counts tasks."""
    params: dict[str, Any] = {
        "status": cursor.kind,
        "age": cursor.age.total_seconds(),
        "after_at": cursor.workflows_after[0],
        "after_id": cursor.workflows_after[1],
        "limit": limit,
    }
    started = time.perf_counter()
    with without_jit(), connections[using].cursor() as db:
        db.execute(PRUNE_WORKFLOWS_SQL, params)
        rows = db.fetchall()
    members = rows[0][2] if rows else 0
    if rows:
        cursor.workflows_after = max((row[0], row[1]) for row in rows)
        cursor.deleted += members
    cursor.done = len(rows) < limit
    return Batch(cursor.kind, members, time.perf_counter() - started)


def count_prunable(kind: str, age: dt.timedelta, *, queue: str | None = None, using: str = DEFAULT_DB_ALIAS) -> int:
    statement = _COUNT_SQL["TASKS" if kind in FINISHED_STATUSES else kind]
    with without_jit(), connections[using].cursor() as db:
        db.execute(statement, {"status": kind, "queue": queue, "age": age.total_seconds()})
        return int(db.fetchone()[0])


def prune(
    ages: dict[str, dt.timedelta],
    *,
    batch_size: int | None = None,
    queue: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
    on_batch: Callable[[Batch, PruneCursor], None] | None = None,
    pause: Callable[[Batch], None] | None = None,
) -> dict[str, int]:
    """Prune every kind in ``ages`` to the end, batch after batch; returns rows deleted per kind."""
    limit = batch_size or get_settings().RETENTION_BATCH_SIZE
    totals: dict[str, int] = {}
    for kind in KINDS:
        if kind not in ages:
            continue
        cursor = PruneCursor(kind, ages[kind])
        while not cursor.done:
            batch = prune_batch(cursor, limit=limit, queue=queue if kind in FINISHED_STATUSES else None, using=using)
            if on_batch is not None:
                on_batch(batch, cursor)
            if pause is not None and not cursor.done:
                pause(batch)
        totals[kind] = cursor.deleted
    return totals


def sweep_orphans(after: dict[str, int], *, limit: int, using: str = DEFAULT_DB_ALIAS) -> int:
    """One batch of each of the steps and the events tables (ORPHANS_SQL), from ``after`` (the last
    task id each batch read, moved on here; back to 0 once a table's end is reached, so each batch
    reads the next part and a pass over the table is spread over many calls); returns rows deleted."""
    deleted = 0
    with without_jit(), connections[using].cursor() as db:
        for table, statement in ORPHANS_SQL.items():
            db.execute(statement, {"after": after.get(table, 0), "limit": limit})
            last, picked, gone = db.fetchone()
            after[table] = last if picked >= limit else 0
            deleted += gone
    return deleted


@dataclass
class AutoPruner:
    """Automatic pruning for the recovery leader: a pass over every kind every ``interval``
    seconds, run a slice at a time (``run_for``) between recovery rounds so that recovery is never
    held up by more than a slice, and the pass never takes more than its share of the time."""

    using: str = DEFAULT_DB_ALIAS
    interval: float = field(default_factory=lambda: get_settings().RETENTION_INTERVAL)
    batch_size: int = field(default_factory=lambda: get_settings().RETENTION_BATCH_SIZE)
    clock: Callable[[], float] = time.monotonic
    _pass: Iterator[PruneCursor] | None = None
    _current: PruneCursor | None = None
    _next_pass_at: float = 0.0
    deleted: dict[str, int] = field(default_factory=dict)
    #: Where the sweep of orphaned steps and events stands (sweep_orphans): a batch per completed pass.
    orphans_after: dict[str, int] = field(default_factory=dict)

    def _new_pass(self) -> Iterator[PruneCursor] | None:
        policy = retention_policy()
        if policy is None:
            return None
        return iter([PruneCursor(kind, age) for kind, age in policy.items() if age is not None])

    def run_for(self, budget: float) -> int:
        """Delete batches for up to ``budget`` seconds (at least one batch when a pass is due);
        returns rows deleted."""
        now = self.clock()
        if self._current is None and self._pass is None:
            if now < self._next_pass_at:
                return 0
            self._pass = self._new_pass()
            if self._pass is None:
                self._next_pass_at = now + self.interval
                return 0
        deadline = now + budget
        deleted = 0
        while True:
            if self._current is None or self._current.done:
                if self._current is not None and self._current.deleted:
                    logger.info("retention: pruned %d %s", self._current.deleted, self._current.kind.lower())
                assert self._pass is not None
                self._current = next(self._pass, None)
                if self._current is None:  # pass complete
                    self._pass = None
                    orphans = sweep_orphans(self.orphans_after, limit=self.batch_size, using=self.using)
                    if orphans:
                        logger.info("retention: deleted %d orphaned steps and events", orphans)
                    self._next_pass_at = self.clock() + self.interval
                    return deleted + orphans
            batch = prune_batch(self._current, limit=self.batch_size, using=self.using)
            deleted += batch.deleted
            self.deleted[batch.kind] = self.deleted.get(batch.kind, 0) + batch.deleted
            if self.clock() >= deadline:
                return deleted

    @property
    def idle(self) -> bool:
        """No pass in progress (the last one completed, or none started)."""
        return self._pass is None and self._current is None

    def reset(self) -> None:
        """Forget the pass in progress (after a database error: the next call starts a new one)."""
        self._pass = None
        self._current = None
