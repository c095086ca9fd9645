"""Bulk operations: retry, cancel or discard every task matching a filter, in the background.

A request only validates the filter (:func:`parse_filter`) and inserts a ``tasks_bulkoperation`` row;
the recovery leader works through it a batch at a time (tasks/maintenance/bulk.py), each batch ONE
statement (:data:`BULK_SQL`) that picks the next matching ids after the operation's cursor, changes
those whose row still allows it, and advances the cursor and the counts on the operation's row, in
the same transaction. Hence:

- each task is changed at most once per operation: the cursor only grows, in id order, and it moves in
  the statement that changed the rows (a leader that dies mid-batch changed nothing of that batch);
- a RUNNING task is never taken from its worker: no kind applies to RUNNING;
- a row that moved between the pick and the update (a worker finished, claimed or failed it, an
  operator changed it) is re-checked by PostgreSQL on its newest version (the UPDATE's WHERE repeats
  the pick's guard and filter) and counted as skipped, not changed;
- a statement's work is bounded: it reads at most ``span`` ids of the primary key (or of the status
  index) after the cursor, so a filter that matches little does not make one statement walk the table.

What each kind does is what the single-task operations do (tasks/models/task.py): ``retry`` is
``TaskQuerySet.requeue`` (finished tasks run again with fresh attempts), ``cancel`` is
``TaskQuerySet.cancel`` without RUNNING, ``discard`` fails waiting tasks for good (FAILED, with an
error entry naming the operation), as a handler's ``Discard`` does.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from leasing.validation import parse_iso_datetime
from tasks import redaction
from tasks.lifecycle.fragments import append_error
from tasks.lifecycle.states import TaskStatus
from tasks.lifecycle.storable import is_storable
from tasks.lifecycle.transitions import rerun_set_sql

#: The kinds of operation, and the statuses each applies to (a filter's ``status`` must be among them).
KIND_STATUSES: dict[str, tuple[str, ...]] = {
    "retry": (TaskStatus.FAILED.value, TaskStatus.CANCELLED.value, TaskStatus.SUCCESSFUL.value),
    "cancel": (TaskStatus.AWAITING.value, TaskStatus.BLOCKED.value, TaskStatus.READY.value),
    "discard": (TaskStatus.AWAITING.value, TaskStatus.BLOCKED.value, TaskStatus.READY.value),
}
#: The statuses a kind applies to when the filter names none: a retry never re-runs SUCCESSFUL tasks
#: unless asked to by name.
DEFAULT_STATUSES: dict[str, tuple[str, ...]] = {
    "retry": (TaskStatus.FAILED.value, TaskStatus.CANCELLED.value),
    "cancel": KIND_STATUSES["cancel"],
    "discard": KIND_STATUSES["discard"],
}
KINDS = tuple(KIND_STATUSES)

#: An operation's own statuses.
PENDING, RUNNING, DONE, CANCELLED, FAILED = "PENDING", "RUNNING", "DONE", "CANCELLED", "FAILED"
OPEN = (PENDING, RUNNING)

FILTER_FIELDS = (
    "status",
    "queue",
    "task_path",
    "workflow_id",
    "dedup_key",
    "enqueued_after",
    "enqueued_before",
    "finished_after",
    "finished_before",
    "args_contains",
    "kwargs_contains",
)
_TEXT_FIELDS = {"queue": 100, "task_path": 255, "dedup_key": 255}
_TIME_FIELDS = ("enqueued_after", "enqueued_before", "finished_after", "finished_before")
_MAX_ID = 2**63 - 1
#: Bytes of a containment document: a search term, not a payload.
MAX_CONTAINS_BYTES = 4096


class BulkFilterError(ValueError):
    """A bulk operation's kind or filter is not valid; ``field`` names the part at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _when(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise BulkFilterError(f"{name} must be an ISO 8601 date-time string", name)
    try:
        when = parse_iso_datetime(value)
    except ValueError:
        raise BulkFilterError(f"{name} is not an ISO 8601 date-time: {value!r}", name) from None
    if when.tzinfo is None:
        raise BulkFilterError(f"{name} needs a time zone (e.g. 2026-01-31T12:00:00+00:00)", name)
    try:
        # Stored in UTC: Python reads offsets up to +-23:59 with seconds and fractions, PostgreSQL only
        # up to +-15:59:59 in whole seconds (a filter the leader could not read was stored).
        return when.astimezone(dt.timezone.utc).isoformat()
    except (OverflowError, ValueError):
        raise BulkFilterError(f"{name} is out of range: {value!r}", name) from None


def parse_filter(kind: Any, data: Any) -> dict[str, Any]:
    """The filter of an operation of ``kind`` as stored (JSON, every field checked; ``status`` always
    set: the statuses it applies to). Raises :class:`BulkFilterError` and nothing is written."""
    if not isinstance(kind, str) or kind not in KIND_STATUSES:
        raise BulkFilterError(f"kind must be one of {', '.join(KINDS)}", "kind")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BulkFilterError("filter must be a JSON object", "filter")
    unknown = sorted(set(data) - set(FILTER_FIELDS))
    if unknown:
        raise BulkFilterError(
            f"unknown filter field(s): {', '.join(map(str, unknown))} (known: {', '.join(FILTER_FIELDS)})", "filter"
        )
    result: dict[str, Any] = {}
    statuses = data.get("status")
    if statuses is None:
        result["status"] = sorted(DEFAULT_STATUSES[kind])
    else:
        if isinstance(statuses, str):
            statuses = [statuses]
        if not isinstance(statuses, list) or not statuses or not all(isinstance(s, str) for s in statuses):
            raise BulkFilterError("filter.status must be a status or a non-empty list of statuses", "filter.status")
        wrong = [s for s in statuses if s not in KIND_STATUSES[kind]]
        if wrong:
            raise BulkFilterError(
                f"a {kind} applies to {', '.join(KIND_STATUSES[kind])} tasks, not {', '.join(wrong)}"
                + (" (a RUNNING task is never taken from its worker)" if TaskStatus.RUNNING.value in wrong else ""),
                "filter.status",
            )
        result["status"] = sorted(set(statuses))
    for name, max_length in _TEXT_FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value or len(value) > max_length or "\x00" in value:
            raise BulkFilterError(
                f"filter.{name} must be a non-empty string of at most {max_length} characters", f"filter.{name}"
            )
        result[name] = value
    workflow = data.get("workflow_id")
    if workflow is not None:
        if isinstance(workflow, bool) or not isinstance(workflow, int) or not 0 < workflow <= _MAX_ID:
            raise BulkFilterError("filter.workflow_id must be a positive integer", "filter.workflow_id")
        result["workflow_id"] = workflow
    for name in _TIME_FIELDS:
        if data.get(name) is not None:
            result[name] = _when(f"filter.{name}", data[name])
    for name, shape in (("args_contains", list), ("kwargs_contains", dict)):
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, shape) or not value:
            what = "a non-empty JSON array" if shape is list else "a non-empty JSON object"
            raise BulkFilterError(f"filter.{name} must be {what}", f"filter.{name}")
        if not is_storable(value) or len(json.dumps(value)) > MAX_CONTAINS_BYTES:
            raise BulkFilterError(
                f"filter.{name} must be plain JSON of at most {MAX_CONTAINS_BYTES} bytes", f"filter.{name}"
            )
        if redaction.hides_part_of(**{name.removesuffix("_contains"): value}):
            # Its matched count would tell whether a hidden value is the one guessed.
            raise BulkFilterError(
                f"filter.{name} names an argument that LEASING_TASKS['REDACT_ARGUMENTS'] hides", f"filter.{name}"
            )
        result[name] = value
    return result


def filter_params(stored: dict[str, Any]) -> dict[str, Any]:
    """The statement parameters of a stored filter (absent fields are NULL: their condition is true)."""
    params: dict[str, Any] = {name: stored.get(name) for name in (*_TEXT_FIELDS, "workflow_id", *_TIME_FIELDS)}
    params["statuses"] = list(stored["status"])
    for name in ("args_contains", "kwargs_contains"):
        params[name] = None if stored.get(name) is None else json.dumps(stored[name])
    return params


# -- the statement ---------------------------------------------------------------------------------
#
# The filter, written once for the pick and again for the update (which PostgreSQL re-checks on the
# newest version of a row changed since the statement's snapshot). Every optional field is
# ``(%(x)s IS NULL OR …)``: the values are sent inline (client-side binding), so the planner folds the
# absent ones away and keeps the rest as index conditions.
_FILTER = """t.status = ANY(%(statuses)s::text[])
      AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
      AND (%(task_path)s::text IS NULL OR t.task_path = %(task_path)s::text)
      AND (%(dedup_key)s::text IS NULL OR t.dedup_key = %(dedup_key)s::text)
      AND (%(workflow_id)s::bigint IS NULL OR t.workflow_id = %(workflow_id)s::bigint)
      AND (%(enqueued_after)s::timestamptz IS NULL OR t.enqueued_at >= %(enqueued_after)s::timestamptz)
      AND (%(enqueued_before)s::timestamptz IS NULL OR t.enqueued_at < %(enqueued_before)s::timestamptz)
      AND (%(finished_after)s::timestamptz IS NULL OR t.finished_at >= %(finished_after)s::timestamptz)
      AND (%(finished_before)s::timestamptz IS NULL OR t.finished_at < %(finished_before)s::timestamptz)
      AND (%(args_contains)s::jsonb IS NULL OR t.args @> %(args_contains)s::jsonb)
      AND (%(kwargs_contains)s::jsonb IS NULL OR t.kwargs @> %(kwargs_contains)s::jsonb)"""

_DISCARD_ENTRY = """jsonb_build_object(
            'type', 'tasks.Discarded', 'message', 'discarded by bulk operation ' || op.id,
            'traceback', '', 'kind', 'discard', 'at', clock_timestamp())"""

# What each kind writes: the single-task operations' SET lists (TaskQuerySet.requeue's is RERUN_SET, .cancel's) and
# a discard's error entry, capped as every error list is (tasks/lifecycle/fragments.py, append_error).
_SETS = {
    # "Run again" is defined once, for requeue and this alike (tasks/lifecycle/transitions.py).
    "retry": rerun_set_sql(),
    "cancel": """status = 'CANCELLED',
    finished_at = clock_timestamp()""",
    "discard": f"""status = 'FAILED',
    finished_at = clock_timestamp(),
    {append_error(_DISCARD_ENTRY)}""",
}


# Where a batch's window ends: after the cursor, up to ``span`` past the next id that exists (a gap
# left by retention or the mover is jumped in one probe of each primary key), never past the last id
# that existed when the operation was requested. A retry's next id is the lower of tasks_task's and
# tasks_finished's (the mover's rows are retried too); the other kinds' statuses never move.
def _window_end(kind: str) -> str:
    first = "(SELECT min(n.id) FROM tasks_task AS n WHERE n.id > op.cursor)"
    if kind == "retry":
        first = f"LEAST({first}, (SELECT min(f.id) FROM tasks_finished AS f WHERE f.id > op.cursor))"
    return f"""window_end AS MATERIALIZED (
    SELECT LEAST(op.last_id, COALESCE({first}, op.last_id) + %(span)s - 1) AS hi
    FROM op
)"""


# The first ``batch`` matching ids of the window, in id order; ``moved``: the row is in tasks_finished
# (a retry's only: the mover took it there), read by its day partitions' primary keys.
def _picked(kind: str) -> str:
    hot = f"""SELECT t.id, false AS moved FROM tasks_task AS t, op, window_end AS w
    WHERE t.id > op.cursor AND t.id <= w.hi
      AND {_FILTER}
    ORDER BY t.id
    LIMIT %(batch)s"""
    if kind != "retry":
        return hot
    return f"""SELECT id, moved FROM (
    ({hot})
    UNION ALL
    (SELECT t.id, true FROM tasks_finished AS t, op, window_end AS w
    WHERE t.id > op.cursor AND t.id <= w.hi
      AND {_FILTER}
    ORDER BY t.id
    LIMIT %(batch)s)
    ) AS both_tables
    ORDER BY id
    LIMIT %(batch)s"""


def _bulk_sql(kind: str) -> str:
    # op: the operation's row, locked for the statement (FOR UPDATE re-reads its newest version, so a
    #   cancel that committed meanwhile stops it, and two sessions never run one batch twice: the
    #   second waits, then reads the cursor the first moved).
    # window: the ids this statement may read (_window_end).
    # picked: the first ``batch`` matching ids of the window, in id order (MATERIALIZED: runs once).
    # changed: the conditional update; a row that moved since the snapshot is re-checked against the
    #   same guard on its newest version and left alone (skipped).
    # restored (a retry's): the picked rows of tasks_finished back into tasks_task as they are
    #   (RESTORE_SQL's move: a row restored or retired meanwhile is not found, skipped); the caller
    #   requeues them (RETRY_RESTORED_SQL) in the batch's transaction, their ids the last column.
    # The cursor becomes the last id picked when the batch is full (ids after it are still to read),
    # else the window's end.
    restore = ""
    restored_count = ""
    id_columns = ""  # a retry's two more columns: the ids it restored, the ids it missed
    if kind == "retry":
        restore = """,
back AS (
    DELETE FROM tasks_finished AS f USING picked
    WHERE f.id = picked.id AND picked.moved
    RETURNING f.*
),
restored AS (
    INSERT INTO tasks_task SELECT * FROM back
    RETURNING id
)"""
        restored_count = " + (SELECT count(*) FROM restored)"
        id_columns = ", (SELECT array_agg(id ORDER BY id) FROM restored)"
        # missed: rows picked in tasks_task that the update found gone (the mover took them after the
        # snapshot): the caller looks for them in tasks_finished (RETRY_MISSED_SQL).
        id_columns += """, (SELECT array_agg(p.id ORDER BY p.id) FROM picked AS p
    WHERE NOT p.moved AND NOT EXISTS (SELECT 1 FROM changed AS c WHERE c.id = p.id))"""
    return f"""
WITH op AS MATERIALIZED (
    SELECT b.id, b.cursor, b.last_id FROM tasks_bulkoperation AS b
    WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
    FOR UPDATE
),
{_window_end(kind)},
picked AS MATERIALIZED (
    {_picked(kind)}
),
changed AS (
    UPDATE tasks_task AS t SET
    {_SETS[kind]}
FROM picked, op
WHERE t.id = picked.id{" AND NOT picked.moved" if kind == "retry" else ""}
      AND {_FILTER}
    RETURNING t.id
){restore},
counts AS MATERIALIZED (
    SELECT (SELECT count(*) FROM picked) AS picked,
           (SELECT count(*) FROM changed){restored_count} AS changed,
           (SELECT max(id) FROM picked) AS last_picked
)
UPDATE tasks_bulkoperation AS b SET
    status = CASE WHEN (CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END) >= b.last_id
                  THEN 'DONE' ELSE 'RUNNING' END,
    cursor = CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END,
    matched = b.matched + c.picked,
    changed = b.changed + c.changed,
    skipped = b.skipped + c.picked - c.changed,
    batches = b.batches + 1,
    started_at = COALESCE(b.started_at, clock_timestamp()),
    updated_at = clock_timestamp(),
    finished_at = CASE WHEN (CASE WHEN c.picked >= %(batch)s THEN c.last_picked ELSE w.hi END) >= b.last_id
                       THEN clock_timestamp() END
FROM op, window_end AS w, counts AS c
WHERE b.id = op.id
RETURNING b.status, b.cursor, b.matched, b.changed, b.skipped, c.picked, c.changed{id_columns}
"""


#: One batch of a bulk operation of each kind (see :func:`_bulk_sql`).
BULK_RETRY_SQL = _bulk_sql("retry")
# A cancel's batch: waiting tasks (never RUNNING) become CANCELLED.
BULK_CANCEL_SQL = _bulk_sql("cancel")
# A discard's batch: waiting tasks fail for good (FAILED, with an error entry saying so).
BULK_DISCARD_SQL = _bulk_sql("discard")
# Each kind's batch by its name, as the operation's row gives it (tasks/models/bulk.py).
BULK_SQL = {"retry": BULK_RETRY_SQL, "cancel": BULK_CANCEL_SQL, "discard": BULK_DISCARD_SQL}

# A retry of one row at a time, when a batch's retry collided with the unique dedup key of unfinished
# tasks (tasks_task_dedup_unfinished: another task with the key is waiting or running, or two retried
# rows share a key). The batch's statement rolled back whole; each row of it is tried alone under a
# savepoint and a collision is counted as skipped. Same guard as the batch's.
BULK_RETRY_ONE_SQL = f"""
WITH op AS MATERIALIZED (
    SELECT b.id FROM tasks_bulkoperation AS b
    WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
)
UPDATE tasks_task AS t SET
    {_SETS["retry"]}
FROM op
WHERE t.id = %(task)s
      AND {_FILTER}
RETURNING t.id
"""

# The ids a retry's batch would pick, without changing anything (the one-row fallback's list): id,
# the window's end, and whether the row is in tasks_finished.
BULK_PICK_SQL = f"""
WITH op AS MATERIALIZED (
    SELECT b.id, b.cursor, b.last_id FROM tasks_bulkoperation AS b
    WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
    FOR UPDATE
),
{_window_end("retry")},
picked AS MATERIALIZED (
    {_picked("retry")}
)
SELECT p.id, w.hi, p.moved FROM picked AS p, window_end AS w
ORDER BY p.id
"""

# The requeue of the rows a retry's batch brought back from tasks_finished (RERUN_SET, as a retry of a
# row of tasks_task writes), in the batch's transaction: a dedup key another unfinished task holds
# fails it, and the batch is redone a row at a time.
RETRY_RESTORED_SQL = f"""
UPDATE tasks_task AS t SET
    {_SETS["retry"]}
WHERE t.id = ANY(%(ids)s::bigint[])
RETURNING t.id
"""

# A retry's rows the batch picked in tasks_task but found gone when it came to change them: the mover
# took them to tasks_finished after the batch's snapshot (its delete committed while the batch waited
# for the row). In the batch's transaction, after its statement (a new snapshot, in which the move is
# seen), those of them in tasks_finished that still match come back unchanged (this statement), are
# requeued (RETRY_RESTORED_SQL: a statement of its own, which sees the rows this one inserts) and
# counted changed, not skipped (MISSED_COUNTED_SQL). A row gone for another reason (deleted, rerun by
# someone else) is not in tasks_finished: it stays skipped.
RETRY_MISSED_SQL = f"""
WITH back AS (
    DELETE FROM tasks_finished AS t
    WHERE t.id = ANY(%(ids)s::bigint[]) AND {_FILTER}
    RETURNING t.*
)
INSERT INTO tasks_task SELECT * FROM back
RETURNING id
"""
# Rows a retry batch picked in tasks_task but found taken by the mover meanwhile, brought back from
# tasks_finished and run again: counted changed, not skipped, on the operation's row.
MISSED_COUNTED_SQL = """
UPDATE tasks_bulkoperation AS b SET
    changed = b.changed + %(found)s,
    skipped = b.skipped - %(found)s
WHERE b.id = %(operation)s
RETURNING b.status, b.cursor, b.matched, b.changed, b.skipped
"""

# Progress of a batch done one row at a time (the fallback above), in the same transaction.
BULK_ADVANCE_SQL = """
UPDATE tasks_bulkoperation AS b SET
    status = CASE WHEN %(cursor)s >= b.last_id THEN 'DONE' ELSE 'RUNNING' END,
    cursor = %(cursor)s,
    matched = b.matched + %(picked)s,
    changed = b.changed + %(changed)s,
    skipped = b.skipped + %(picked)s - %(changed)s,
    batches = b.batches + 1,
    started_at = COALESCE(b.started_at, clock_timestamp()),
    updated_at = clock_timestamp(),
    finished_at = CASE WHEN %(cursor)s >= b.last_id THEN clock_timestamp() END
WHERE b.id = %(operation)s AND b.status IN ('PENDING', 'RUNNING')
RETURNING b.status, b.cursor, b.matched, b.changed, b.skipped
"""


# An operation whose statement the database refuses for good (a value out of range in a filter written
# around the validation, say) ends FAILED with the reason, instead of holding up the operations after it.
BULK_FAIL_SQL = """
UPDATE tasks_bulkoperation SET status = 'FAILED', error = %(error)s, finished_at = clock_timestamp(),
    updated_at = clock_timestamp()
WHERE id = %(operation)s AND status IN ('PENDING', 'RUNNING')
"""


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one batch did, and where its operation stands after it."""

    status: str
    cursor: int
    matched: int
    changed: int
    skipped: int
    batch_picked: int
    batch_changed: int

    @property
    def open(self) -> bool:
        return self.status in OPEN
