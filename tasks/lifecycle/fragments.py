"""The pieces several task statements share, spliced into them when their modules load: the claim's
RETURNING, the start marker (``START_SET``), the compare-and-set guards (``HELD``, ``OWNED``, ``LIVE``),
the backoff and the capped error history. Each statement reads whole in ``tasks/sql/lifecycle/``."""

from __future__ import annotations

# A keyed task that backs off (or whose rate key refused its start) gives its concurrency slot up: it
# waits BLOCKED and is admitted again once due (tasks/lifecycle/concurrency.py). Its slot goes to the
# next waiting task in the same statement.
WAITING_STATUS = "CASE WHEN t.concurrency_key IS NULL THEN 'READY' ELSE 'BLOCKED' END"

CLAIM_RETURNING = (
    "t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at,"
    " t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids,"
    " (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect,"
    " t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after,"
    " t.retry_policy, t.rate_key, t.trace_context"
)


# The start marker. Idempotent (a resent marker whose first copy committed changes nothing and still
# matches), so a worker that lost the reply may simply send it again. ``at`` is the executor's own
# start time (what the handler was told) in epoch seconds (cheaper to send than timestamps); NULL
# means "now" on the database clock (the statement's timestamp: one value for both columns).
# An attempt that ended before its marker was sent is marked by the statement that records its end
# (finish or fail: a row may be changed only once per statement, so the marker never goes beside it).
START_SET = """
    attempt_started = true,
    attempts = t.attempts + (NOT t.attempt_started)::int,
    started_at = COALESCE(t.started_at, to_timestamp(d.at), statement_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at
                             ELSE COALESCE(to_timestamp(d.at), statement_timestamp()) END,
    worker_ids = CASE WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END"""
STARTS = "unnest(%(start_ids)s::bigint[], %(start_tokens)s::bigint[], %(start_at)s::float8[]) AS d(id, token, at)"

# "This worker holds the row", written so that no index but the primary key can serve it. The
# rows an attempt names are found by id (one primary-key probe each). Written plainly, ``holder = w
# AND status = 'RUNNING'`` lets the planner read an index of the running rows instead: a holder
# index's range (w, 'RUNNING') did (before migration 0045 took the running rows out of
# tasks_task_holder_state_idx), whose entries included every row version this worker ever held
# RUNNING until vacuum removed them: beside an old snapshot (a forgotten transaction) none could be
# removed, and each finish and heartbeat read all of them (2,600 blocks after 60,000 tasks,
# growing); the expiry index's whole running set would be the same. Inside COALESCE neither the
# partial indexes' predicate nor the holder column is visible to the planner.
HELD = "COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false)"


# The error history is bounded: a task failing, crashing or being requeued forever must not grow a
# row without end (40 requeues of a 100 KB traceback made a 4.4 MB row). The first entry (how it
# started to go wrong) and the newest MAX_ERRORS - 1 are kept; each entry dropped to make room is
# counted in ``errors_dropped``. The newest entry stays last (``errors -> -1`` is how a worker whose
# reply was lost tells that its write landed).
MAX_ERRORS = 10
ERRORS_FULL = f"(jsonb_array_length(t.errors) >= {MAX_ERRORS})"


def capped_errors(entry: str, *, when: str | None = None, table: str = "t") -> dict[str, str]:
    """The new values of ``errors`` and ``errors_dropped`` (keyed by column) once ``entry`` (a jsonb
    object expression) is appended, capped; with ``when`` (a boolean expression, never NULL), only on
    rows where it holds (the others keep both). ``table`` is the alias the columns are read through;
    ``""`` reads them unqualified, as an ORM ``update()`` of tasks_task must (the operator's cancel)."""
    errors = f"{table}.errors" if table else "errors"
    dropped = f"{table}.errors_dropped" if table else "errors_dropped"
    full = f"(jsonb_array_length({errors}) >= {MAX_ERRORS})"
    if when is None:
        return {
            "errors": f"CASE WHEN {full} THEN ({errors} - 1) ELSE {errors} END || jsonb_build_array({entry})",
            "errors_dropped": f"{dropped} + {full}::int",
        }
    return {
        "errors": f"""CASE WHEN NOT ({when}) THEN {errors} WHEN {full} THEN ({errors} - 1) ELSE {errors} END
        || CASE WHEN ({when}) THEN jsonb_build_array({entry}) ELSE '[]'::jsonb END""",
        "errors_dropped": f"{dropped} + (({when}) AND {full})::int",
    }


def append_error(entry: str, *, when: str | None = None) -> str:
    """SET items appending ``entry`` (a jsonb object expression) to ``t.errors``, capped; with
    ``when``, only where it holds (:func:`capped_errors`)."""
    return ",\n    ".join(f"{column} = {value}" for column, value in capped_errors(entry, when=when).items())


def owned(ids: str) -> str:
    """The rows an attempt names (``d``, an unnest of the array parameter ``ids`` and its tokens) that
    this worker still holds. ``t.id = ANY(ids)`` repeats the join on the table's own side so that the
    primary key is probed for the named ids whatever the join below it: a plan made while the table was
    small (a fresh or truncated table, kept as a prepared statement's generic plan while it grows) was
    a hash join over a scan of the whole primary key (11,414 blocks to finish 16 tasks;
    docs/explanation/benchmarks.md, "Sustained load against the peers")."""
    return f"t.id = ANY(%({ids})s::bigint[]) AND t.id = d.id AND t.token = d.token AND {HELD}"


OWNED = owned("ids")
LIVE = "t.expires_at > clock_timestamp()"
