"""Start, heartbeat, checkpoint and finish of an attempt: the start marker of a suspect (``START_SQL``;
a rate-limited task's is the grant, ``RATE_START_SQL`` in tasks/lifecycle/ratelimits.py), the
heartbeat, the checkpoint, the completion, the failure / retry / snooze / cancel by the handler
(``FAIL_SQL``) and the hand-back.

Attempt accounting (invariants 10 and 14): a claim does not charge an attempt; a *start marker* does. It
sets ``attempt_started``, bumps ``attempts`` and appends the worker to ``worker_ids``, so
``attempts`` counts attempts that began. The marker rides on the statement that records the
attempt's end, or on the dispatcher's next round for a longer one (``FINISH_START_CLAIM_SQL``: no extra
round trip on the hot path), so an attempt runs for about one round trip before its marker commits.
So that a worker vanishing inside that window does not leave an attempt that ran looking unstarted,
an executor is handed an attempt only once a committed round statement named it on the worker's own
row (``tasks_worker.handed``, ``_HANDING_CTE``: one row per round, whatever the batch), and recovery
counts a named attempt as begun: charged, recorded as the crash of an attempt. Only a claim the
worker had not handed over goes back uncharged as unstarted; ``unstarted_returns`` + 1 makes the task
a *suspect*, and a suspect (never named: its start is its own) is marked by ``START_SQL`` *before*
its handler runs.
How an attempt ends decides what it costs:

- the handler's own outcome (an exception, a timeout, an unstorable result): ``failures`` + 1;
  ``max_attempts`` bounds failures;
- the worker vanished while the attempt ran (its lease expired after START): ``crashes`` + 1;
  ``MAX_CRASHES`` bounds crashes, so a poison pill that kills every worker it lands on still ends
  FAILED, while a task that merely ran beside it is not charged a *failure*;
- the lease expired before START (prefetched, never begun), or a graceful hand-back: nothing.

Every statement reads ``clock_timestamp()`` (the clock under the row lock, not the transaction's
start) and every write to a held row is a compare-and-set on id + holder + token + RUNNING.
"""

from __future__ import annotations

from tasks.lifecycle.fragments import HELD, LIVE, OWNED, START_SET, STARTS, WAITING_STATUS, append_error, owned
from tasks.lifecycle.policy import RETRYABLE, backoff_sql

# A suspect's attempt is marked before its handler runs (one statement, by the executor).
START_SQL = f"""
UPDATE tasks_task AS t SET {START_SET},
    attempt_isolated = %(isolated)s::boolean
FROM {STARTS}
WHERE {owned("start_ids")}
  AND t.expires_at > clock_timestamp()
RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
"""

# One statement renews every task the worker still holds, and records the worker as alive. Each row
# is a compare-and-set on holder + id + TOKEN: a stale client reusing a worker name renews nothing.
# Only the worker process's own beat (``record_worker``) writes its row: an API client's heartbeat,
# refused or not, must not wipe the worker's stats or revive a worker recorded as stopped.
HEARTBEAT_SQL = f"""
WITH mine AS (
    SELECT t.id FROM tasks_task AS t
    JOIN unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token) ON t.id = d.id AND t.token = d.token
    WHERE t.id = ANY(%(ids)s::bigint[]) AND {HELD} AND t.expires_at > clock_timestamp()
    FOR UPDATE OF t SKIP LOCKED
), renewed AS (
    UPDATE tasks_task AS t
    SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
        renewed_at = clock_timestamp(),
        renewals = t.renewals + 1
    FROM mine WHERE t.id = mine.id
    RETURNING t.id, t.token
), busy AS (
    SELECT t.id, t.token FROM tasks_task AS t
    JOIN unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token) ON t.id = d.id AND t.token = d.token
    WHERE t.id = ANY(%(ids)s::bigint[]) AND {HELD} AND t.expires_at > clock_timestamp()
      AND t.id NOT IN (SELECT id FROM mine)
), unkept AS (
    -- Slots kept for this worker's handlers (tasks/lifecycle/concurrency.py) whose handler is no longer running
    -- (``live``: the attempts with a handler or a thread of theirs running in the process now): one
    -- that recovery kept after the handler had returned, or one whose release was lost. A tiny table.
    DELETE FROM tasks_concurrencyhold AS h
    WHERE h.worker = %(worker)s AND %(record_worker)s::boolean AND %(reconcile)s::boolean
      AND NOT EXISTS (SELECT 1 FROM unnest(%(live_ids)s::bigint[], %(live_tokens)s::bigint[]) AS l(id, token)
                      WHERE l.id = h.task_id AND l.token = h.token)
), seen AS (
    UPDATE tasks_worker SET previous_seen_at = last_seen_at, last_seen_at = clock_timestamp(),
                            running = %(running)s, stats = %(stats)s::jsonb, stopped_at = NULL, stop_reason = ''
    WHERE id = %(worker)s AND %(record_worker)s::boolean
    RETURNING 1
)
SELECT true, id, token FROM renewed
UNION ALL
SELECT false, id, token FROM busy
"""

# A handler's progress, stored only while this attempt holds the live lease (a fenced write).
CHECKPOINT_SQL = """
UPDATE tasks_task SET progress = %(progress)s::jsonb, progress_at = clock_timestamp()
WHERE id = %(id)s AND holder = %(worker)s AND token = %(token)s AND status = 'RUNNING'
  AND expires_at > clock_timestamp()
"""


COMPLETE_SET = f"""{START_SET},
    status = 'SUCCESSFUL',
    return_value = d.return_value,
    finished_at = clock_timestamp(),
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())"""

# Successes alone (a round with no claim and no marker): the lighter finish, fenced like every finish,
# each result with the time its attempt began when the start was not marked.
COMPLETE_SQL = f"""
UPDATE tasks_task AS t SET {COMPLETE_SET}
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(values)s::jsonb[], %(started)s::float8[])
         AS d(id, token, return_value, at)
WHERE {OWNED} AND {LIVE}
RETURNING t.id, t.token
"""


# How an attempt the handler ended other than by returning is recorded (``d.kind``, per row):
# - 'fail': the handler raised (or timed out, or returned what cannot be stored): one of
#   ``max_attempts`` spent; back to waiting after the backoff while retryable, else FAILED. ``d.retry``
#   false (a discard, an exception outside the policy's ``retry_on``) fails it for good at once.
#   ``d.delay``: the policy's backoff in seconds (NULL: the default exponential backoff), added to the
#   database clock here; ``d.max_attempts``: the policy's limit when the row's is not the one that
#   applies (tasks/lifecycle/policy.py; written to the row, so that it shows the limit applied).
# - 'snooze': waiting again at clock + ``d.delay``, not charged: the start marker's charge is undone
#   (``attempts``, and the worker it appended to ``worker_ids``: django.tasks counts attempts by
#   worker_ids), no error entry; ``snoozes`` + 1 and ``snoozed_at`` (the dashboard's "snoozed").
# - 'cancel': CANCELLED with the reason as the last error entry (kind 'cancel'); the workflow
#   triggers settle its dependants as for any move into a final status (migration 0016).
# One statement whatever the mix, each row a compare-and-set on id + holder + token + live lease.
_SNOOZE = "(d.kind = 'snooze')"
_WAITS = f"({_SNOOZE} OR {RETRYABLE})"  # RETRYABLE: the retry decision's database half (policy.py)


# When an attempt whose start marker rides on this statement began (a short attempt ends before the
# dispatcher sends its marker, and so does one whose marker waited behind a long poll): the epoch the
# worker stamped as it called the handler (``d.at``, Failure.started), as COMPLETE_SQL records it. This
# statement's own clock is the attempt's end: as its start it made every such attempt last 0 s.
# NULL (an API client's report) falls back to that clock.
_ATTEMPT_START = "COALESCE(to_timestamp(d.at), clock_timestamp())"

# The error entry of a failed or cancelled attempt (a snooze writes none): the handler's own error with
# the attempt it ended.
_FAIL_ENTRY = f"""d.error || jsonb_build_object(
        'attempt', t.attempts + (NOT t.attempt_started)::int, 'worker', t.holder, 'token', t.token,
        'kind', CASE WHEN d.kind = 'cancel' THEN 'cancel' ELSE 'failure' END, 'at', clock_timestamp(),
        'started_at', CASE WHEN t.attempt_started THEN t.last_attempted_at ELSE {_ATTEMPT_START} END,
        'position', jsonb_array_length(t.worker_ids) + (NOT t.attempt_started)::int)"""


# A failed attempt is the handler's own outcome: it costs one of ``max_attempts``. The error entry
# carries the attempt's token so a worker whose reply was lost can tell that this write landed.
FAIL_SQL = f"""
UPDATE tasks_task AS t SET
    status = CASE WHEN {_WAITS} THEN {WAITING_STATUS} WHEN d.kind = 'cancel' THEN 'CANCELLED' ELSE 'FAILED' END,
    run_after = CASE WHEN {_SNOOZE} THEN clock_timestamp() + make_interval(secs => COALESCE(d.delay, 0))
                     WHEN {RETRYABLE} THEN clock_timestamp()
                          + COALESCE(make_interval(secs => d.delay), {backoff_sql("t.failures")})
                     ELSE t.run_after END,
    finished_at = CASE WHEN {_WAITS} THEN NULL ELSE clock_timestamp() END,
    failures = t.failures + (d.kind = 'fail')::int,
    max_attempts = COALESCE(d.max_attempts, t.max_attempts),
    snoozes = t.snoozes + {_SNOOZE}::int,
    snoozed_at = CASE WHEN {_SNOOZE} THEN clock_timestamp() END,
    attempt_started = false,
    attempt_isolated = false,
    attempts = CASE WHEN {_SNOOZE} THEN t.attempts - t.attempt_started::int
                    ELSE t.attempts + (NOT t.attempt_started)::int END,
    started_at = COALESCE(t.started_at, to_timestamp(d.at), clock_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at ELSE {_ATTEMPT_START} END,
    worker_ids = CASE WHEN {_SNOOZE} THEN (CASE WHEN t.attempt_started THEN t.worker_ids - (-1) ELSE t.worker_ids END)
                      WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END,
    {append_error(_FAIL_ENTRY, when="d.kind <> 'snooze'")},
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(errors)s::jsonb[], %(retry)s::boolean[], %(kinds)s::text[],
            %(delays)s::float8[], %(max_attempts)s::int[], %(started)s::float8[])
     AS d(id, token, error, retry, kind, delay, max_attempts, at)
WHERE {OWNED} AND {LIVE}
RETURNING t.id, t.status, t.run_after,
          -- how long until it is due again, on the database clock (the worker's log says it)
          EXTRACT(EPOCH FROM t.run_after - clock_timestamp())::float8
"""

_HAND_BACK_ENTRY = """jsonb_build_object(
        'attempt', t.attempts, 'worker', t.holder, 'token', t.token, 'kind', 'shutdown', 'at', clock_timestamp(),
        'started_at', t.last_attempted_at, 'position', jsonb_array_length(t.worker_ids),
        'exception_class_path', 'tasks.exceptions.WorkerShutdown',
        'message', %(reason)s::text, 'traceback', '')"""

# Hand-back (graceful shutdown, or claims the worker cannot run): runnable again at once, keeping its
# place. Nothing is charged. An interrupted attempt that had started stays counted in ``attempts``
# (it did begin; ``worker_ids`` names it) and gets an error entry saying why it ended.
HAND_BACK_SQL = f"""
UPDATE tasks_task AS t SET
    status = 'READY',
    run_after = LEAST(t.run_after, clock_timestamp()),
    attempt_started = false,
    attempt_isolated = false,
    snoozed_at = NULL,  -- due now: no longer waiting for a wake time
    {append_error(_HAND_BACK_ENTRY, when="t.attempt_started")},
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token)
WHERE {OWNED}
RETURNING t.id, t.token
"""
