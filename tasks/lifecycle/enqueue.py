"""Enqueue: the statements that insert task rows (one task; with a dedup key; unique for a window;
debounced; many at once). Every write reads the database clock (docs/explanation/design.md)."""

from __future__ import annotations

INSERT_COLUMNS = (
    "queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts, max_attempts,"
    " timeout, dedup_key, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,"
    " unstarted_returns, attempt_started, attempt_isolated"
)

# ``backend_alias`` and ``task_run_after`` are set for a django.tasks backend's rows only (the bulk
# insert leaves them NULL): which backend enqueued it, and the Task's own run_after as enqueued.
# ``trace_context``: the enqueuing span's context while tracing is on (tasks/tracing.py), else NULL:
# a NULL parameter and a NULL column (one bit of the row's null bitmap) are all a plain enqueue pays.
# A task with a ``concurrency_key`` is inserted READY like any other; the database's trigger turns it
# BLOCKED and admits it when its key has a free slot (tasks/lifecycle/concurrency.py).
_ENQUEUE_COLUMNS = f"""{INSERT_COLUMNS}, backend_alias, task_run_after, concurrency_key, concurrency_limit,
                        retry_policy, rate_key, rate_limit, rate_period, trace_context, fair_key"""


def _enqueue_values(run_after: str = "COALESCE(%(run_after)s::timestamptz, statement_timestamp())") -> str:
    """The enqueue's VALUES, ``run_after`` its start (a debounce computes its own)."""
    return (
        ("%(queue)s::text, %(priority)s::smallint, %(task_path)s::text, %(args)s::jsonb, %(kwargs)s::jsonb, 'READY',")
        + f"""
        {run_after}, statement_timestamp(), 0, %(max_attempts)s::int,
        %(timeout)s::float8, %(dedup_key)s::text, '[]'::jsonb, '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false,
        %(backend_alias)s::text,
        CASE WHEN %(backend_alias)s::text IS NULL THEN NULL ELSE %(run_after)s::timestamptz END,
        %(concurrency_key)s::text, %(concurrency_limit)s::int, %(retry_policy)s::jsonb,
        %(rate_key)s::text, %(rate_limit)s::int, %(rate_period)s::float8, %(trace_context)s::jsonb,
        %(fair_key)s::text"""
    )


_ENQUEUE_INSERT = f"""
INSERT INTO tasks_task ({_ENQUEUE_COLUMNS})
VALUES ({_enqueue_values()})"""
# A task without a dedup key cannot conflict: a plain insert. ON CONFLICT makes every insert a
# speculative one (a speculative-insertion lock and its WAL record), a tenth of the statement's time.
ENQUEUE_SQL = f"""{_ENQUEUE_INSERT}
RETURNING id, enqueued_at
"""
# With a dedup key: nothing if an unfinished task holds the key (the caller then looks it up).
ENQUEUE_DEDUP_SQL = f"""{_ENQUEUE_INSERT}
ON CONFLICT (dedup_key) WHERE status IN ('BLOCKED', 'READY', 'RUNNING') AND dedup_key IS NOT NULL DO NOTHING
RETURNING id, enqueued_at
"""

# Unique for a window (``unique_for``; tasks/lifecycle/windows.py): the key's row in tasks_uniquekey is
# the window. ``accepted`` opens one: a new key row, or the key's row replaced by a DO UPDATE that fires
# only once its window has passed, judged under the row's lock on its newest version (two enqueues of
# the key queue on that lock: the second sees the first's window and takes nothing). The task's id is
# drawn before the insert so the key row can name it. No row is proposed at all while an unfinished
# task holds the dedup key (the dedup promise stays: a window extends it, never shortens it), so the
# window is left as it was. ``inserted`` runs only for a key row taken; its ON CONFLICT meets only a
# plain dedup enqueue of the same key that committed after this statement's snapshot: the key row
# then names a task that was never inserted, which the caller sees (``enqueued_at`` NULL) and undoes
# (RELEASE_UNIQUE_KEY_SQL). A refused duplicate still holds the key row's lock until its transaction
# ends (ON CONFLICT DO UPDATE locks the row before it tests the WHERE): enqueues of one key inside long
# transactions queue behind each other, as inserts of one unique value do; other keys never wait.
#
# The window starts when the key is taken, never before. An INSERT computes its row (the clock in
# its SELECT) before the arbiter index is checked, and that check waits for another transaction's
# uncommitted insert of the key or delete of its row: when that one rolls back (or the delete, a
# prune, commits), the insert goes on with the row computed before the wait, a window that may have
# ended before the enqueue was accepted (1 run in 6 through PgBouncer). So every wait
# comes first, in ``taken``: the key's transaction-level advisory lock, which every enqueue of the key
# through this statement takes before it inserts (an uncommitted first window of the key holds it),
# then the lock of the key's row as the snapshot has it (a prune's uncommitted delete holds that one;
# a row deleted meanwhile is simply not there). The clock is read after both, in ``accepted``'s
# SELECT, whose only input is ``taken``. The lock's two halves: the table's oid (a namespace of
# this table's own, resolved when the statement is parsed) and the key's hash, whose rare collisions
# make two keys queue behind each other, never share a window. A transaction-level lock ends with the
# transaction: no session state is left on a pooled connection (invariant 13). The DO UPDATE branch
# reads its clock under the row lock already.
# Costs: one primary-key probe of tasks_uniquekey (two with the lock) and one probe of
# tasks_task_dedup_unfinished, whatever the number of keys or finished rows.
ENQUEUE_UNIQUE_SQL = f"""
WITH proposed AS MATERIALIZED (
    SELECT pg_advisory_xact_lock('tasks_uniquekey'::regclass::oid::integer, hashtext(%(dedup_key)s::text))
    WHERE NOT EXISTS (SELECT 1 FROM tasks_task AS held
                      WHERE held.dedup_key = %(dedup_key)s::text AND held.status IN ('BLOCKED', 'READY', 'RUNNING'))
), taken AS MATERIALIZED (
    SELECT k.key FROM proposed LEFT JOIN (
        SELECT k.key FROM tasks_uniquekey AS k WHERE k.key = %(dedup_key)s::text FOR UPDATE
    ) AS k ON true
), accepted AS (
    INSERT INTO tasks_uniquekey AS k (key, task_id, accepted_at, expires_at)
    SELECT %(dedup_key)s::text, nextval(pg_get_serial_sequence('tasks_task', 'id')), clock_timestamp(),
           clock_timestamp() + make_interval(secs => %(unique_for)s::float8)
    FROM taken
    ON CONFLICT (key) DO UPDATE
    SET task_id = EXCLUDED.task_id, accepted_at = clock_timestamp(),
        expires_at = clock_timestamp() + make_interval(secs => %(unique_for)s::float8)
    WHERE k.expires_at <= clock_timestamp()
    RETURNING k.task_id
), inserted AS (
    INSERT INTO tasks_task (id, {_ENQUEUE_COLUMNS})
    SELECT a.task_id, {_enqueue_values()} FROM accepted AS a
    ON CONFLICT (dedup_key) WHERE status IN ('BLOCKED', 'READY', 'RUNNING') AND dedup_key IS NOT NULL DO NOTHING
    RETURNING id, enqueued_at
)
SELECT a.task_id, i.enqueued_at FROM accepted AS a LEFT JOIN inserted AS i ON i.id = a.task_id
"""

# Debounce (``debounce``, ``max_wait``; tasks/lifecycle/windows.py): one upsert whose arbiter is
# tasks_task_debounce_waiting, a partial unique index on (task_path, debounce_key) over *waiting* rows
# (BLOCKED, READY) never claimed (``transitions`` 0: only a claim bumps it) only: a key is debounced
# per task path, and a claimed task that waits again (retry, hand-back, recovery, requeue) is never
# folded into nor meets the key's newer task. While a task of the path and key waits, the
# insert becomes an update of it: its arguments replaced, its start pushed to now + delay under its
# row lock (clock_timestamp(), read after any wait for the lock), never past ``debounce_until`` (its
# first enqueue + max_wait; LEAST ignores a NULL: no cap). Against a worker's claim: a claim that
# committed first has taken the row out of the index, and PostgreSQL, finding the conflicting row
# changed under its lock, checks the index again, finds no waiting row and inserts a new task; while
# this statement holds the row lock, a claim skips the row (SKIP LOCKED); a claim whose pick saw the
# row before this committed locks its newest version and re-checks the pick on it, finding it not yet
# due. So a debounce never changes the arguments of an attempt already claimed. The DO UPDATE's WHERE
# says it again, as a compare-and-set on the status and the claim count (no row: the caller tries
# again). ``debounces`` is 0 on a row just inserted (NULL on every row not debounced) and counts the
# enqueues folded into it. A keyed task already admitted to its concurrency key's slots (READY) whose
# start is pushed later gives its slot up in this statement: it waits BLOCKED, and the statement's
# own admission (the AFTER UPDATE triggers of tasks/lifecycle/concurrency.py, which an upsert's DO
# UPDATE fires) hands the slot to the key's next due waiting task; a READY task holds a slot, so one
# that cannot run before its new start must not be READY (a debounce left the slot idle
# while the key's other tasks waited). A start that stays due (``debounce_until``, the max_wait cap,
# already passed: LEAST keeps it) keeps the slot. The cost:
# one probe of a unique index that holds only the waiting debounced rows.
ENQUEUE_DEBOUNCE_SQL = f"""
INSERT INTO tasks_task ({_ENQUEUE_COLUMNS}, debounce_key, debounce_until, debounces)
VALUES ({
    _enqueue_values(
        "LEAST(statement_timestamp() + make_interval(secs => %(debounce)s::float8),"
        " statement_timestamp() + make_interval(secs => %(max_wait)s::float8))"
    )
}, %(debounce_key)s::text, statement_timestamp() + make_interval(secs => %(max_wait)s::float8), 0)
ON CONFLICT (task_path, debounce_key)
    WHERE status IN ('BLOCKED', 'READY') AND debounce_key IS NOT NULL AND transitions = 0
DO UPDATE
SET args = EXCLUDED.args, kwargs = EXCLUDED.kwargs,
    run_after = LEAST(clock_timestamp() + make_interval(secs => %(debounce)s::float8), tasks_task.debounce_until),
    -- The new start is later than now unless the cap has passed (the delay is more than 0).
    status = CASE WHEN tasks_task.concurrency_key IS NOT NULL
                       AND (tasks_task.debounce_until IS NULL OR tasks_task.debounce_until > clock_timestamp())
                  THEN 'BLOCKED' ELSE tasks_task.status END,
    debounces = tasks_task.debounces + 1
WHERE tasks_task.status IN ('BLOCKED', 'READY') AND tasks_task.transitions = 0
RETURNING id, enqueued_at, debounces = 0
"""

# One task kind per statement: everything but the kwargs is one scalar parameter, sent once (arrays
# of a repeated value cost a quarter of the throughput to build, send and unpack). The kwargs come as
# one JSON array text (each element checked storable by the caller, joined): an array of jsonb would
# be quoted element by element on the client and parsed so on the server (16 % of a bulk enqueue).
BULK_ENQUEUE_SQL = f"""
INSERT INTO tasks_task ({INSERT_COLUMNS}, concurrency_key, concurrency_limit, retry_policy, rate_key, rate_limit,
                        rate_period, trace_context, fair_key)
SELECT d.queue, d.priority, d.task_path, d.args, d.kwargs, 'READY', COALESCE(d.run_after, statement_timestamp()),
       statement_timestamp(), 0, d.max_attempts, d.timeout, NULL, '[]'::jsonb, '[]'::jsonb, 0, 0, 0, 0, 0, 0, false,
       false, %(concurrency_key)s::text, %(concurrency_limit)s::int, %(retry_policy)s::jsonb, %(rate_key)s::text,
       %(rate_limit)s::int, %(rate_period)s::float8, %(trace_context)s::jsonb, %(fair_key)s::text
FROM (
    SELECT %(queue)s::text AS queue, %(priority)s::smallint AS priority, %(task_path)s::text AS task_path,
           %(args)s::jsonb AS args, k AS kwargs, %(run_after)s::timestamptz AS run_after,
           %(max_attempts)s::int AS max_attempts, %(timeout)s::float8 AS timeout
    FROM jsonb_array_elements(%(kwargs)s::jsonb) AS k
) AS d
RETURNING id
"""
