"""The task queue's SQL: every hot path is one statement (see docs/explanation/design.md, "Statement shapes").

Why one module of ~600 lines: these statements share their fragments (the claim's SET, the
compare-and-set guards, the recovery CTEs) and are the ones the state machine's table names
(tasks/lifecycle/transitions.py); in one file a reader sees every write to a task row at once.

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

from collections.abc import Sequence
from typing import Any

from leasing.models import GRANT_SET
from tasks.lifecycle.values import ClaimPosition, FairPosition, FairPositions, fair_positions_json


def _backoff_sql(exponent: str) -> str:
    """Capped exponential backoff with 50-100 % jitter, as an interval (computed in the database)."""
    return (
        "make_interval(secs => LEAST(%(backoff_max)s, %(backoff_base)s * power(2, GREATEST(" + exponent + ", 0)))"
        " * (0.5 + random() / 2))"
    )


# A keyed task that backs off (or whose rate key refused its start) gives its concurrency slot up: it
# waits BLOCKED and is admitted again once due (tasks/lifecycle/concurrency.py). Its slot goes to the
# next waiting task in the same statement.
_WAITING_STATUS = "CASE WHEN t.concurrency_key IS NULL THEN 'READY' ELSE 'BLOCKED' END"

CLAIM_RETURNING = (
    "t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at,"
    " t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids,"
    " (t.crashes > 0 OR t.shared_crashes > 0 OR t.unstarted_returns > 0) AS suspect,"
    " t.shared_crashes >= %(isolate_after)s, t.backend_alias, t.task_run_after, t.api_origin, t.run_after,"
    " t.retry_policy, t.rate_key, t.trace_context"
)

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
# ended before the enqueue was accepted (breaker 32: 1 run in 6 through PgBouncer). So every wait
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
# that cannot run before its new start must not be READY (breaker 32: a debounce left the slot idle
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
# of a repeated value cost a quarter of the throughput to build, send and unpack).
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
    FROM unnest(%(kwargs)s::jsonb[]) AS k
) AS d
RETURNING id
"""

# ``%(start)s`` is false for a worker's claim (the start marker follows when an executor begins the
# task) and true for an HTTP client's claim, which begins the attempt as it returns; but not a task
# with a rate key: its start must be granted by RATE_START_SQL, which the API sends next.
_STARTS_NOW = "(%(start)s::boolean AND t.rate_key IS NULL)"
_CLAIM_SET = f"""
    status = 'RUNNING',
    holder = %(worker)s::text,
    {GRANT_SET},
    transitions = t.transitions + 1,
    attempt_started = {_STARTS_NOW},
    attempt_isolated = false,
    attempts = t.attempts + {_STARTS_NOW}::int,
    started_at = CASE WHEN {_STARTS_NOW} THEN COALESCE(t.started_at, clock_timestamp()) ELSE t.started_at END,
    last_attempted_at = CASE WHEN {_STARTS_NOW} THEN clock_timestamp() ELSE t.last_attempted_at END,
    worker_ids = CASE WHEN {_STARTS_NOW} THEN t.worker_ids || jsonb_build_array(%(worker)s::text)
                      ELSE t.worker_ids END"""

# The subquery picks and locks; SKIP LOCKED lets concurrent workers pick different rows without
# waiting. It reads the partial index tasks_task_claim_idx (queue, priority DESC, run_after, id,
# shared_crashes) WHERE status = 'READY', so a claim reads only runnable rows of its own queue:
# finished rows and other queues' backlogs cost it nothing. A task that must run isolated
# (``shared_crashes`` at ISOLATE_AFTER) is taken only by a worker that holds nothing else:
# ``isolation_bar`` is ISOLATE_AFTER for a busy worker and no bar at all for an idle one (one
# statement text either way).
#
# Deferred rows: one ordered scan ``queue = q AND run_after <= now ORDER BY priority DESC, run_after,
# id`` meets a higher priority's deferred rows before a lower priority's due ones, and (run_after being
# behind priority in the index) steps over every one of them. PostgreSQL 18's skip scan jumps over
# them; 13-17 have none, and 300,000 deferred rows made a claim cost x32 on PostgreSQL 15. So the
# claim walks the priorities itself (a manual skip scan, on every major): ``levels`` is the queue's
# distinct priorities among READY rows, highest first, each found by one index probe (the next
# priority below the last: ``ORDER BY priority DESC LIMIT 1``, an index-only scan that stops at the
# first live entry); for each, in that order, a LATERAL range scan ``priority = p AND run_after <=
# now ORDER BY run_after, id`` takes the due rows, locking as it goes. A nested loop pulls rows one by
# one through the outer LIMIT, so no row is locked that is not claimed (tests/db/test_claim_plans.py
# counts the LockRows output), and a level is probed only once the levels above it gave too little.
# The recursion emits one row per step, so the CTE scan yields the levels in priority order with no
# Sort. Its cost: one probe per distinct priority holding READY rows above the first one with due
# rows (a handful), not one per deferred row. A step to the next priority must find a *live* entry:
# index entries of rows that left READY and are not yet vacuumed are stepped over (as the old scan
# stepped over those at the front of its range; each is marked dead in the index on first visit).
#
# A pick that locks with LIMIT … FOR UPDATE SKIP LOCKED must run exactly once per statement: as an
# uncorrelated ARRAY(…) (an InitPlan) here, as a MATERIALIZED CTE where its columns are needed. Joined
# as a subquery (FROM (…) AS picked WHERE t.id = picked.id), it may be planned as the inner side of
# a nested loop and run again for every row of the outer table (statistics that say the table is
# empty lead there); each run skips the rows the statement already changed and locks the next ones,
# so a claim of 5 took a queue's every task (tests/db/test_pick_once.py).
# A paused queue (a row of tasks_queuecontrol) gives nothing: checked once per queue per statement
# (a primary-key probe), so a pause holds from the next claim of every worker and HTTP client.
#
# Resuming where the last claims stopped. Beside an old snapshot (a forgotten
# transaction, an analytics query, pg_dump) no claimed row's index entry can be removed, nor marked
# dead: each claim used to step over every row claimed since the snapshot was taken, one heap visit
# each, from the front of its level (100,000 tasks drained at 0.40x of their free rate). A worker
# passes, per queue and priority level, the position (run_after, id) of the last row it claimed
# there (``after_queues``, ``after_priorities``, ``after_run_afters``, ``after_ids``; empty arrays: a
# scan from the start). A worker of several queues keeps one per queue and level: both steps of
# _PICK_MANY (the shares and the locking) scan each level after its queue's position.
# A level with a position is range-scanned after it. The walk over the levels never crosses the front
# of a level it has a position for: from a level L it probes only the priorities between L and the
# highest positioned level below L, and falls back to that level itself (K below). A level above
# every position is found by the same probe from the top, so a new higher-priority task is taken at
# once. What a position passes over, a READY row that appeared behind it (a hand-back keeping its
# place, a keyed task admitted when a slot freed, a row another claimer skipped and let go), the
# worker's next scan from the start takes: a worker resumes only while its claims come back full (a
# backlog), scans from the start after a short one, and at least every RESCAN_INTERVAL
# (tasks/worker/dispatcher.py), so such a row waits at most that long.
_POSITIONS = (
    "unnest(%(after_queues)s::text[], %(after_priorities)s::smallint[], %(after_run_afters)s::timestamptz[],"
    " %(after_ids)s::bigint[]) AS k(queue, priority, run_after, id)"
)


def _next_level(below: str, queue: str = "%(queue)s") -> str:
    """The next priority below ``below`` holding READY rows of ``queue``, without crossing the
    front of a positioned level: the highest positioned level below ``below`` (K) bounds the probe,
    and is the answer when nothing lies between."""
    known = f"(SELECT max(k.priority) FROM {_POSITIONS} WHERE k.queue = {queue} AND k.priority < {below})"
    return f"""CASE WHEN {known} IS NULL THEN
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = {queue} AND t.priority < {below}
             ORDER BY t.priority DESC LIMIT 1)
        ELSE COALESCE(
            (SELECT t.priority FROM tasks_task AS t
             WHERE t.status = 'READY' AND t.queue = {queue} AND t.priority < {below} AND t.priority > {known}
             ORDER BY t.priority DESC LIMIT 1),
            {known})
        END"""


def _start(queue: str) -> str:
    """Where a level ``l`` of ``queue`` is scanned from: after its position, or its front
    ('-infinity', 0)."""
    where = f"FROM {_POSITIONS} WHERE k.queue = {queue} AND k.priority = l.priority"
    return f"""COALESCE((SELECT k.run_after {where}), '-infinity') AS run_after,
               COALESCE((SELECT k.id {where}), 0) AS id"""


_PICK_ONE = f"""
WHERE t.id = ANY(ARRAY(
    WITH RECURSIVE levels(priority) AS (
        SELECT {_next_level("32767")}
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT {_next_level("levels.priority")}
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.priority, {_start("%(queue)s")} FROM levels AS l
    )
    SELECT due.id FROM placed AS l
    CROSS JOIN LATERAL (
        SELECT id FROM tasks_task
        WHERE status = 'READY' AND queue = %(queue)s AND priority = l.priority AND run_after <= statement_timestamp()
          AND (run_after, id) > (l.run_after, l.id)
          AND shared_crashes < %(isolation_bar)s
        ORDER BY run_after, id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS due
    LIMIT %(limit)s
))"""

# Several queues, in two steps, so that only the rows claimed are locked. A row locked and not
# claimed is skipped by every other claimer until the statement commits: locking each queue's best
# ``limit`` and keeping the best ``limit`` of those made a one-queue worker pass over its queue's best
# task while nobody claimed it (a priority inversion). First, without locks, the best ``limit`` of each
# queue decide how many of the best ``limit`` overall each queue gives (``share``); then each queue
# locks that many, skipping rows other claimers hold, exactly as a one-queue claim does. Both steps
# walk each queue's priorities as the one-queue pick does (one ``levels`` recursion carrying the
# queue, read by both); within a queue the CTE scan yields its levels highest first.
_PICK_MANY = f"""
WHERE t.id = ANY(ARRAY(
    WITH RECURSIVE levels(queue, priority) AS (
        SELECT u.name, {_next_level("32767", "u.name")}
        FROM unnest(%(queues)s::text[]) AS u(name)
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol AS c WHERE c.name = u.name AND c.paused)
        UNION ALL
        SELECT levels.queue, {_next_level("levels.priority", "levels.queue")}
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.queue, l.priority, {_start("l.queue")} FROM levels AS l
    )
    SELECT p.id FROM (
        SELECT best.queue, count(*) AS share FROM (
            SELECT l.queue, r.priority, r.run_after, r.id FROM placed AS l CROSS JOIN LATERAL (
                SELECT id, priority, run_after FROM tasks_task
                WHERE status = 'READY' AND queue = l.queue AND priority = l.priority
                  AND run_after <= statement_timestamp() AND (run_after, id) > (l.run_after, l.id)
                  AND shared_crashes < %(isolation_bar)s
                ORDER BY run_after, id
                LIMIT %(limit)s
            ) AS r
            ORDER BY r.priority DESC, r.run_after, r.id
            LIMIT %(limit)s
        ) AS best
        GROUP BY best.queue
    ) AS s CROSS JOIN LATERAL (
        SELECT due.id FROM placed AS l CROSS JOIN LATERAL (
            SELECT id FROM tasks_task
            WHERE status = 'READY' AND queue = s.queue AND priority = l.priority
              AND run_after <= statement_timestamp() AND (run_after, id) > (l.run_after, l.id)
              AND shared_crashes < %(isolation_bar)s
            ORDER BY run_after, id
            LIMIT s.share
            FOR UPDATE SKIP LOCKED
        ) AS due
        WHERE l.queue = s.queue
        LIMIT s.share
    ) AS p
    LIMIT %(limit)s -- cuts nothing (the shares add up to at most this); tells the planner how few rows come
))"""

# Fair queues (LEASING_TASKS["FAIR_QUEUES"]): a claim takes turns between the queue's keys (tenants,
# ``fair_key``) instead of draining the oldest key first. Plain queues never send this pick (their
# statements are the ones above, unchanged). It reads tasks_task_fair_idx (queue, fair_key, priority
# DESC, run_after, id) WHERE status = 'READY' AND fair_key IS NOT NULL:
#
# - ``walk``: the keys with due rows, in key order, starting after ``fair_after`` (where this
#   claimer's last walk went: FAIR_CURSOR; NULL: from the first key) and wrapping around once, at
#   most ``limit`` of them: a loose index scan, one index probe per key (the first entry above the
#   last key in the index's own order, ``ORDER BY fair_key, priority DESC, run_after, id LIMIT 1``,
#   as the levels walk finds priorities). That entry is the first READY row of the key's highest
#   priority level, and a level's first row is its earliest (run_after is the next index column), so
#   the same probe says whether that level is due; when it is not, the key's lower levels are probed
#   one at a time until one is (``_due``: lazy, the ``own`` walk's probes). ``wrapped``: past the
#   last key, back from the first; the lap ends at ``fair_after`` itself (served last).
#   A key with nothing due (every READY row of it deferred: run_after in the future, snoozed,
#   scheduled) takes no turn: the walk passes over it. When it took one (breaker 33), 100 tenants
#   with only deferred tasks took nearly every turn of every claim, and the room they left went to
#   the fill, the oldest tenant's backlog: a noisy tenant started 1,020 tasks while four small ones
#   started their 40. A fair fill (the room dealt again to the walked keys with due rows) could not
#   mend that: when the walk's ``limit`` keys have nothing due there is no such key to deal to. The
#   walk has to reach further, and once it does, the quotas below deal the whole ``limit`` between
#   the keys it found. So that 100,000 keys with nothing due still cost a bounded claim, the walk
#   visits at most _WALK_KEYS keys in all (FAIR_WALK_KEYS_PER_TURN * limit + FAIR_WALK_KEYS_EXTRA,
#   72 for a claim of 10), those it passes over included (two probes each: its entry, and the level
#   below it that is not there): its cost is bounded by the claim's limit, never by the number of
#   keys or rows. When it stops there, the next claim goes on from the last key it visited
#   (FAIR_CURSOR), so every key with due rows is reached within keys / _WALK_KEYS claims; during
#   such a lap, claims whose walk finds fewer than ``limit`` keys with due rows leave the room to the
#   fill. A key whose due rows are all locked by other claimers (or wait for an idle worker: the
#   isolation bar) still takes its turn; SKIP LOCKED decides what its turn gives.
# - ``fair``: each key of the walk, in walk order, gives its due rows in its own claim order
#   (priority DESC, run_after, id), at most its turn's quota, locking as it goes (SKIP LOCKED): the
#   claim's ``limit`` turns dealt one at a time round the lap's keys, so key number n of k takes
#   (limit - n) / k + 1 and the quotas add up to ``limit`` exactly (none is cut short by the LIMIT):
#   two tenants share a claim half and half, a thousand take one each, ``limit`` at a time, the
#   next claim dealing on after the key that took the last turn (FAIR_CURSOR, returned on each row:
#   the statement's walk says where it went, the client reasons about no key order). With 3 turns
#   over keys a and b, a takes 2 and b 1, and the next claim starts at b (b 2, a 1).
#   Priorities order a key's own tasks; they do not let one key go before the others: a tenant that
#   enqueues everything at a high priority cannot starve the rest (keys take turns whatever their
#   priorities). A key's turn walks its own priorities (``own``: one probe per level, for the level's
#   first READY row, where that level's scan starts), and each level's scan ends at its first row not
#   yet due (run_after is the next index column), so deferred rows of a higher priority in front of a
#   key's due ones are passed over level by level, never read one by one (one range scan over the key
#   in (priority DESC, run_after, id) order read every one of them: 3,056 blocks for a claim of 10
#   behind 200,000 such rows on PostgreSQL 15, 164 now, bench/fair_claims.py; 18's skip scan did the
#   same walk by itself). The walk is lazy: it stops at the level that fills the key's quota. Its
#   scans start after the claimer's positions in the key (below).
# - the fill: a claim is never short while due rows are left. When the keys' turns leave room (fewer
#   keys with due rows within the walk's reach than the claim's limit, with fewer due rows than
#   their quota, or locked; rows of the queue enqueued before it became fair, with no key), the
#   rest comes from the plain pick over tasks_task_claim_idx (the levels walk of _PICK_ONE from
#   each level's front, or after the claimer's positions: below), passing over the rows ``fair``
#   took.
#   Its LIMIT is the room left: 0 when ``fair`` filled the claim, and a Limit of 0 reads nothing.
#
# ``fair`` is a MATERIALIZED CTE (locking rows, it must run exactly once: see above), bounded by
# ``limit`` inside; the fill reads its ids once (an InitPlan). The CTEs sit at the top of the claim
# statement (WITH RECURSIVE: ``walk`` and ``levels`` recurse) so that RETURNING can read the walk;
# the finish-and-claim forms put them after ``finished``.
#
# Resuming beside an old snapshot (breaker 33): no claimed row's entry can be removed from either
# index while the snapshot lives, and a scan from a key's front (or a level's, for the fill) steps
# over every row of it claimed since the snapshot began, one heap visit each: under a noisy tenant
# (the case fair queues exist for) each claim's cost grew with the rows claimed (368 -> 14,637 blocks
# after 50,000 claims, 1,000,000 rows, PostgreSQL 15). So a fair claim resumes as a plain one does
# ("Resuming where the last claims stopped" above, the same worker rules: positions only while its
# claims come back full, dropped at each claim from the front, at least every RESCAN_INTERVAL):
# - each key's turn starts after the claimer's last row of that key and level (``after_key_positions``:
#   ``mine``, the key's own, read once per turn): ``own`` walks the key's levels as _next_level walks
#   a queue's, its probe bounded by the highest positioned level below (a new higher priority of the
#   key, or a level between two positioned ones, is found at once; a positioned level is scanned
#   after its position, never from its front). A worker keeps the positions of the keys it claimed
#   from most recently (4 x its batch size: FairPositions), and sends them only while its claims come
#   back to those keys (going round more keys, it would send them for nothing); a key without one
#   starts from its front.
# - the fill starts each level after the claimer's plain positions (``placed``; from its front
#   without one), which come from the rows the fill took only (FAIR_CLAIM_RETURNING says which): the
#   rows a key's turn took are no place in the level's order (the other keys' rows before them are
#   not claimed).
# - the walk never probes across a key the claimer has positions in (the next one above the last
#   key, found in their sorted names: ``_positioned_after``): its probe for the next key stops short
#   of it, and when nothing lies between, that key is the next one, its due rows looked for after
#   its positions (``_due_after_positions``: its turn's own levels, each probed for a due row after
#   where its scan starts). A probe from the key's front stepped over every row of it claimed since
#   the snapshot began: under a noisy tenant, most of what a claim still read (3,511 of 3,773 blocks
#   beside 50,000 claimed, bench/fair_claims.py --only-noisy, PostgreSQL 15; 93 now, 86 without the
#   snapshot, 7,650 from the front). A positioned key with nothing due after its positions takes no
#   turn, as any key with nothing due.
# What a position passes over (a hand-back, a recovered row, an enqueue with run_after in the past,
# behind the key's last claimed row) is taken by the key's first turn after the next claim from the
# front: never skipped for good, as in a plain queue. A turn given positions takes the rows a turn
# from the front takes otherwise (tests/db/test_fair_positions.py drains twin queues both ways).
# Measured (bench/fair_claims.py, PostgreSQL 15, 1,000,000 rows, 1,000 keys): a claim of 10 reads 158
# blocks in its pick; beside a REPEATABLE READ snapshot held while 20,000 rows (20 per key) were
# claimed, 584. A claim of 10 whose walk starts among 100,000 keys with nothing due reads 459 (its 72
# keys), where the walk that gave them turns read 148 and gave the claim to the fill.
_FAIR_ROWS = "status = 'READY' AND queue = %(queue)s"
# The scans of one key's rows (``fair_key = ...``, a strict comparison, implies tasks_task_fair_idx's
# ``fair_key IS NOT NULL``) do not repeat that predicate: written out, it is one more index condition
# of that index only, and where the table has no statistics yet (a fresh table, a burst of new keys
# before autovacuum's ANALYZE) both indexes are estimated at one row, so that one condition's cost
# gave the scan to tasks_task_claim_idx, which reads the whole queue for the key's row: a 4-process
# drain of 100,000 tasks over 100,000 keys ran at 2,900 tasks/s (77,266 rows filtered per turn,
# PostgreSQL 15), 7,600 with statistics (tests/db/test_fair_plans_without_statistics.py).
_FAIR_AFTER = "%(fair_after)s::text"


def _key_entry(after: str | None) -> str:
    """The first entry of the next key (above ``after``) of the queue's READY rows in a fair queue:
    its key, and its highest priority level's first READY row (priority, run_after): one index probe
    (tasks_task_fair_idx's own order), which also tells whether that level is due. The probe stops
    short of the next key the claimer has positions in (its front holds the rows the claimer took
    from it, which an old snapshot keeps in the index); nothing before it: that key is the entry,
    ``positioned``, with no row (_due reads it after its positions)."""
    above = "" if after is None else f" AND f.fair_key > {after}"

    def probe(below: str) -> str:
        return f"""SELECT f.fair_key::text, f.priority, f.run_after, false AS positioned FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.fair_key IS NOT NULL AND f.queue = %(queue)s{above}{below}
                ORDER BY f.fair_key, f.priority DESC, f.run_after, f.id LIMIT 1"""

    return f"""(SELECT e.* FROM (SELECT {_positioned_after(after)} AS next) AS p CROSS JOIN LATERAL (
            ({probe(" AND f.fair_key < p.next")})
            UNION ALL
            (SELECT u.* FROM ({probe("")}) AS u WHERE p.next IS NULL)
            UNION ALL
            SELECT p.next, NULL::smallint, NULL::timestamptz, true WHERE p.next IS NOT NULL
            LIMIT 1) AS e)"""


def _next_entry(after: str, wrapped: str) -> str:
    """The walk's next key: the first entry above ``after``, else (``wrapped`` false: not yet back
    from the first key) the first entry of all, wrapped. Lazy: the wrap is probed only when the
    first probe finds nothing (Append under LIMIT 1)."""
    return f"""(SELECT a.*, {wrapped} AS wrapped FROM {_key_entry(after)} AS a
            UNION ALL
            SELECT b.*, true FROM {_key_entry(None)} AS b WHERE NOT {wrapped}
            LIMIT 1)"""


def _due(entry: str) -> str:
    """Whether the walked key ``entry`` has a due row: the first READY row of one of its priority
    levels is due (run_after is the index column after priority, so a level's first row is its
    earliest). Its highest level is the walk's probe already; the levels below are probed one at a
    time, and only while none is due (lazy: EXISTS stops at the first due level)."""
    return f"""CASE WHEN {entry}.positioned THEN {_due_after_positions(entry)} ELSE EXISTS (
            WITH RECURSIVE level(priority, run_after) AS (
                SELECT {entry}.priority, {entry}.run_after
                UNION ALL
                SELECT b.priority, b.run_after FROM level AS l CROSS JOIN LATERAL (
                    SELECT f.priority, f.run_after FROM tasks_task AS f
                    WHERE f.status = 'READY' AND f.queue = %(queue)s
                      AND f.fair_key = {entry}.fair_key AND f.priority < l.priority
                    ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1) AS b
                WHERE l.run_after > statement_timestamp()
            )
            SELECT FROM level WHERE level.run_after <= statement_timestamp()) END"""


def _due_after_positions(entry: str) -> str:
    """Whether the walked key ``entry``, which the claimer has positions in, has a due row after
    them: its own levels as its turn walks them (``own``), each probed for its first due row after
    where its scan starts (a LATERAL probe, LIMIT 1: as an EXISTS the planner may join the key's
    every due row instead, 10,771 blocks beside a snapshot), lazily (EXISTS stops at the first)."""
    return f"""EXISTS (
            {_own_levels(f"{entry}.fair_key")}
            SELECT FROM own AS o CROSS JOIN LATERAL (
                SELECT FROM tasks_task AS f
                WHERE f.status = 'READY' AND f.queue = %(queue)s
                  AND f.fair_key = {entry}.fair_key AND f.priority = o.priority
                  AND (f.run_after, f.id) > (o.run_after, o.id) AND f.run_after <= statement_timestamp()
                ORDER BY f.run_after, f.id LIMIT 1) AS d)"""


# The claimer's positions in the keys it claimed from lately (``after_key_positions``: a JSON object,
# each key's positions under its name, one per priority level, ``{}``: every key from its front;
# fair_positions_json). A key's turn reads its own once (``mine``): the object is parsed once per
# statement (``positions``, a CTE), and a key found in it by a binary search over its sorted names, so a
# claim's cost does not grow with the number of positions sent (arrays, filtered per key, cost
# 1.7 ms more for a claim of 64 over 64 keys with 256 positions sent, PostgreSQL 15).
def _key_positions(key: str) -> str:
    """The claimer's positions in ``key`` (none: the key from its front)."""
    return (
        f"jsonb_to_recordset((SELECT p.map FROM positions AS p) -> {key})"
        " AS k(priority smallint, run_after timestamptz, id bigint)"
    )


# The keys the claimer has positions in, in key order (``positioned``, a CTE: sorted once per
# statement): the walk finds the next one above a key by a binary search (width_bucket), and never
# probes across one.
_POSITIONED_KEYS = "(SELECT p.keys FROM positioned AS p)"


def _positioned_after(after: str | None) -> str:
    """The first key above ``after`` (None: the first of all) that the claimer has positions in."""
    if after is None:
        return f"{_POSITIONED_KEYS}[1]"
    return f"""{_POSITIONED_KEYS}[width_bucket(({after})::text COLLATE "C", {_POSITIONED_KEYS}) + 1]"""


def _next_own_level(below: str | None, key: str = "w.fair_key") -> str:
    """Where ``key``'s next priority level (below ``below``; None: its highest) is scanned from,
    exclusive: (priority, run_after, id) (``key``: the walked key, ``w``'s in its turn, the walk
    entry's in _due_after_positions). As _next_level walks a queue's levels: the
    highest positioned level of the key below ``below`` (``known``, from ``mine``) bounds one index
    probe for the first READY row of a level above it, whose row is where that level's scan starts
    (id - 1: the row itself is the first one after it; the entries the probe stepped over are not
    read twice); nothing between: ``known`` itself, after its position (never from its front)."""
    under = "" if below is None else f" AND f.priority < {below}"
    mine_under = "" if below is None else f" WHERE m.priority < {below}"
    return f"""(SELECT s.priority, s.run_after, s.id
            FROM (SELECT max(m.priority) AS known FROM mine AS m{mine_under}) AS kn CROSS JOIN LATERAL (
                (SELECT f.priority, f.run_after, f.id - 1 AS id FROM tasks_task AS f
                 WHERE f.status = 'READY' AND f.queue = %(queue)s
                   AND f.fair_key = {key}{under} AND f.priority > COALESCE(kn.known, -32768)
                 ORDER BY f.priority DESC, f.run_after, f.id LIMIT 1)
                UNION ALL
                (SELECT m.priority, m.run_after, m.id FROM mine AS m WHERE m.priority = kn.known)
                LIMIT 1
            ) AS s)"""


def _own_levels(key: str) -> str:
    """The WITH of a key's own levels (``own``: where each of its priority levels is scanned from,
    exclusive, highest first), after the claimer's positions in it (``mine``)."""
    return f"""WITH RECURSIVE mine(priority, run_after, id) AS MATERIALIZED (
                SELECT k.priority, k.run_after, k.id FROM {_key_positions(key)}
            ), own(priority, run_after, id) AS (
                SELECT n.* FROM {_next_own_level(None, key)} AS n
                UNION ALL
                SELECT n.* FROM own AS o CROSS JOIN LATERAL {_next_own_level("o.priority", key)} AS n
            )"""


def _past_lap(walk: str) -> str:
    """A key of the walk (alias ``walk``) past its lap: beyond ``fair_after`` after the wrap."""
    return f"({walk}.wrapped AND COALESCE({walk}.fair_key > {_FAIR_AFTER}, false))"


def _in_lap(walk: str) -> str:
    """A key of the walk (alias ``walk``) that takes a turn: it has due rows and is still in its lap."""
    return f"{walk}.due AND NOT {_past_lap(walk)}"


# How many keys the walk visits at most: ``limit`` keys with due rows, and up to
# FAIR_WALK_KEYS_PER_TURN * limit + FAIR_WALK_KEYS_EXTRA keys in all, those with nothing due
# included (each costs two index probes: its entry, and the level below it). Literals in the
# statement (its text stays constant: prepared once per connection). The constant part keeps small
# claims (an API client's one task, a worker's last free slot) from crawling over the keys with
# nothing due a few at a time; 4 per turn lets a worker's claim of 16 visit 96 keys. Costs
# (bench/fair_claims.py, PostgreSQL 15): a claim of 10 among 100,000 keys with nothing due reads 459
# blocks in its pick (8 per turn and 64: 893); breaker 33's 100 such tenants beside a backlog and
# four small tenants: the backlog tenant started 28 tasks while the four started their 40 (8 and
# 64: 28 too; 2 and 16: 76).
FAIR_WALK_KEYS_PER_TURN = 4
FAIR_WALK_KEYS_EXTRA = 32
_WALK_KEYS = f"(%(limit)s::int * {FAIR_WALK_KEYS_PER_TURN} + {FAIR_WALK_KEYS_EXTRA})"

# How many keys take a turn (at most ``limit``: the walk stops there), never 0 (a divisor).
_LAP_KEYS = f"(SELECT GREATEST(count(*), 1) FROM walk AS v WHERE {_in_lap('v')})"

# The fair pick's CTEs, at the top of the claim statement (so that its RETURNING can read the walk:
# FAIR_CURSOR). ``walk`` and ``levels`` are recursive: the statement's WITH is WITH RECURSIVE.
# ``walk`` starts from a row that is no key of the walk (``fair_after`` itself, taking no turn, 0
# keys visited), so that its step (the probes for the next key and its due rows) is written once:
# the claim's plan has 159 nodes, 229 with the step written for the first key too (101 before the
# positions), and a prepared statement's executor sets up every node on each run.
_FAIR_CTES = f"""walk(fair_key, due, wrapped, n, keys) AS (
        SELECT {_FAIR_AFTER} COLLATE "C", false, false, 0, 0  -- where the walk starts from: no key of it
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT e.fair_key::text COLLATE "C", d.due, e.wrapped, w.n + d.due::int, w.keys + 1
        FROM walk AS w CROSS JOIN LATERAL {_next_entry("w.fair_key", "w.wrapped")} AS e
        CROSS JOIN LATERAL (SELECT {_due("e")} AS due OFFSET 0) AS d
        WHERE w.n < %(limit)s AND w.keys < {_WALK_KEYS}
          AND NOT (w.wrapped AND COALESCE(w.fair_key >= {_FAIR_AFTER}, false))
    ), positions(map) AS MATERIALIZED (
        SELECT %(after_key_positions)s::jsonb
    ), positioned(keys) AS MATERIALIZED (
        SELECT array_agg(p.k ORDER BY p.k) FROM (
            SELECT k COLLATE "C" AS k FROM positions AS m, jsonb_object_keys(m.map) AS k) AS p
    ), fair AS MATERIALIZED (
        SELECT due.id FROM walk AS w CROSS JOIN LATERAL (
            {_own_levels("w.fair_key")}
            SELECT r.id FROM own AS o CROSS JOIN LATERAL (
                SELECT id FROM tasks_task
                WHERE {_FAIR_ROWS} AND fair_key = w.fair_key AND priority = o.priority
                  AND (run_after, id) > (o.run_after, o.id)
                  AND run_after <= statement_timestamp() AND shared_crashes < %(isolation_bar)s
                ORDER BY run_after, id
                LIMIT (%(limit)s::int - w.n) / {_LAP_KEYS} + 1
                FOR UPDATE SKIP LOCKED
            ) AS r
            LIMIT (%(limit)s::int - w.n) / {_LAP_KEYS} + 1
        ) AS due
        WHERE {_in_lap("w")}
        LIMIT %(limit)s
    ), levels(priority) AS (
        SELECT {_next_level("32767")}
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT {_next_level("levels.priority")}
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.priority, {_start("%(queue)s")} FROM levels AS l
    )"""

_PICK_FAIR = """
WHERE t.id = ANY(ARRAY(
    SELECT fair.id FROM fair
    UNION ALL
    (SELECT due.id FROM placed AS l
    CROSS JOIN LATERAL (
        SELECT id FROM tasks_task
        WHERE status = 'READY' AND queue = %(queue)s AND priority = l.priority AND run_after <= statement_timestamp()
          AND (run_after, id) > (l.run_after, l.id)
          AND shared_crashes < %(isolation_bar)s
          AND NOT id = ANY(ARRAY(SELECT fair.id FROM fair))
        ORDER BY run_after, id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS due
    LIMIT %(limit)s - (SELECT count(*) FROM fair))
))"""

# Where the claimer's next turn starts (``fair_cursor``): the key that took the lap's last turn. The
# turns are dealt one row at a time in lap order, ``limit`` of them, so the first ``limit`` mod
# ``keys`` keys of the lap take one more than the rest (``fair``'s quota: (limit - n) / keys + 1),
# and the last turn dealt falls to key number (limit - 1) mod keys + 1: the next claim deals on
# from the key after it. A key's turn counts whether it gave rows or not (all locked, a rate-limited
# key's rows handed back): the cursor is where the walk went, never where the rows came from, so the
# fill (the oldest keys' rows, when a key leaves room) cannot send the turns back to the oldest key.
# A walk that stopped at its bound (_WALK_KEYS keys visited) before its lap's end returns the last
# key it visited instead, whether it took a turn or was passed over (nothing due): every turn went
# to a key before it, and the keys after it are the next claim's, which would otherwise probe the
# same keys with nothing due again and never get past them. NULL: no keyed rows, or none due in a
# whole lap (the caller keeps its cursor).
FAIR_CURSOR = f"""COALESCE(
     (SELECT w.fair_key::text FROM walk AS w WHERE w.keys = {_WALK_KEYS} AND NOT {_past_lap("w")}),
     (SELECT w.fair_key::text FROM walk AS w
      WHERE {_in_lap("w")} AND w.n = (%(limit)s::int - 1) %% {_LAP_KEYS} + 1))"""

# A fair queue's cursor shared by every claimer of the database (tasks_faircursor, tasks/models/
# fair_cursor.py): where a new claimer's turns start, so that a worker recycled by --max-tasks, killed
# and restarted, or deployed, deals on from where the fleet's turns went instead of from the first
# key every life (breaker 33). Off the hot path: a claimer reads it once, when it starts claiming
# from the queue, and keeps its own cursor in memory from then on (FAIR_CURSOR, from each claim);
# it writes back at most once a second, and at a clean stop. One row per fair queue: a primary-key
# probe.
FAIR_CURSOR_READ_SQL = "SELECT fair_after FROM tasks_faircursor WHERE queue = %(queue)s"

# Last writer wins: several claimers of one queue each go round the keys from their own cursor, and
# the row only tells a claimer that starts where the others' turns have got to. Any start is as good
# as any other for the bound (each claim's walk is bounded by its limit, and a claimer reaches every
# key within a lap from wherever it starts); what starved tenants was every new life starting at the
# same place. An older position written over a newer one makes a new claimer serve a few keys twice,
# never skip one. The row changes only when the cursor does (``IS DISTINCT FROM``: a writer whose
# value is already there leaves no dead row version); ``updated_at`` is when it last moved, on the
# database clock.
#
# The write never waits (breaker 34). An API claim writes inside its request's transaction and holds
# the row's lock until the request commits, or longer if the request stalls; an upsert behind it
# waited for that lock (a worker's dispatcher for its lock_timeout every round, an API request with
# no bound at all, its claimed rows locked meanwhile). The cursor is advisory, so a writer that finds
# the row locked leaves it (SKIP LOCKED: someone is writing a position as good as ours). The first
# write of a queue inserts the row; two first writers would wait on each other's uncommitted insert,
# so an insert goes only with the queue's transaction-level advisory lock taken without waiting
# (the loser leaves it; a later write updates the row). Data-modifying CTEs run whether or not the
# INSERT reads them.
FAIR_CURSOR_WRITE_SQL = """
WITH held AS (
    SELECT c.queue FROM tasks_faircursor AS c WHERE c.queue = %(queue)s FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE tasks_faircursor AS c SET fair_after = %(fair_after)s, updated_at = statement_timestamp()
    FROM held WHERE c.queue = held.queue AND c.fair_after IS DISTINCT FROM %(fair_after)s
    RETURNING c.queue
)
INSERT INTO tasks_faircursor (queue, fair_after, updated_at)
SELECT %(queue)s, %(fair_after)s, statement_timestamp()
WHERE NOT EXISTS (SELECT 1 FROM tasks_faircursor AS c WHERE c.queue = %(queue)s)
  AND pg_try_advisory_xact_lock('tasks_faircursor'::regclass::oid::integer, hashtext(%(queue)s::text))
ON CONFLICT (queue) DO NOTHING
"""

NO_ISOLATION_BAR = 2**31 - 1  # ``isolation_bar`` of an idle worker: it may take any task

# Busy workers' claims pass over a task that must run isolated, so under a steady stream no worker is
# ever idle for it. A busy worker looks for one in its queues at most once per poll interval (the
# worker then reserves itself for it: tasks/worker/process.py, IsolationReservation). Reads
# tasks_task_isolation_idx, whose entries are the READY tasks that crashed beside others: a handful,
# whatever the backlog. ``shared_crashes > 0`` is spelled out so that the partial index's predicate is
# proven whatever ISOLATE_AFTER is.
ISOLATED_WAITING_SQL = """
SELECT t.queue FROM tasks_task AS t
WHERE t.status = 'READY' AND t.shared_crashes > 0 AND t.shared_crashes >= %(isolate_after)s
  AND t.queue = ANY(%(queues)s::text[]) AND t.run_after <= statement_timestamp()
  AND NOT EXISTS (SELECT 1 FROM tasks_queuecontrol AS c WHERE c.name = t.queue AND c.paused)
LIMIT 1
"""


def claim_params(
    queues: list[str],
    *,
    busy: bool,
    isolate_after: int,
    after: Sequence[ClaimPosition] = (),
    fair_after: str | None = None,
    fair_positions: FairPositions | Sequence[FairPosition] = (),
) -> dict[str, Any]:
    """The queue, isolation and position parameters of every claim statement (positions: one per
    queue and priority level at most; ``fair_after``: the last key a fair claim served;
    ``fair_positions``: one per fair key and priority level at most, read by a fair claim only)."""
    positions = [p for p in after if p.queue in queues]
    return {
        "fair_after": fair_after,
        "after_key_positions": fair_positions_json(fair_positions),
        "queue": queues[0] if queues else "",
        "queues": queues,
        "isolation_bar": isolate_after if busy else NO_ISOLATION_BAR,
        "after_queues": [p.queue for p in positions],
        "after_priorities": [p.priority for p in positions],
        "after_run_afters": [p.run_after for p in positions],
        "after_ids": [p.id for p in positions],
    }


# A fair claim returns each row's key too, where the claimer's next turn starts (the same on every
# row: FAIR_CURSOR), and whether its key's turn took it (``fair``) or the fill: the claimer's
# positions in the levels (where the next fill resumes) come from the fill's rows only, its positions
# in the keys from both (ClaimPosition, FairPosition). ``fair``'s ids are read once (an InitPlan).
FAIR_CLAIM_RETURNING = f"{CLAIM_RETURNING}, t.fair_key, {FAIR_CURSOR}, t.id = ANY(ARRAY(SELECT fair.id FROM fair))"


def _claim_sql(pick: str, returning: str = CLAIM_RETURNING, ctes: str = "") -> str:
    return f"""{f"{chr(10)}WITH RECURSIVE {ctes}" if ctes else ""}
UPDATE tasks_task AS t SET {_CLAIM_SET}
{pick}
RETURNING {returning}
"""


# The start marker. Idempotent (a resent marker whose first copy committed changes nothing and still
# matches), so a worker that lost the reply may simply send it again. ``at`` is the executor's own
# start time (what the handler was told) in epoch seconds (cheaper to send than timestamps); NULL
# means "now" on the database clock (the statement's timestamp: one value for both columns).
# An attempt that ended before its marker was sent is marked by the statement that records its end
# (finish or fail: a row may be changed only once per statement, so the marker never goes beside it).
_START_SET = """
    attempt_started = true,
    attempts = t.attempts + (NOT t.attempt_started)::int,
    started_at = COALESCE(t.started_at, to_timestamp(d.at), statement_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at
                             ELSE COALESCE(to_timestamp(d.at), statement_timestamp()) END,
    worker_ids = CASE WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END"""
_STARTS = "unnest(%(start_ids)s::bigint[], %(start_tokens)s::bigint[], %(start_at)s::float8[]) AS d(id, token, at)"

# "This worker holds the row", written so that no index but the primary key can serve it. The
# rows an attempt names are found by id (one primary-key probe each). Written plainly, ``holder = w
# AND status = 'RUNNING'`` lets the planner read tasks_task_running_holder_idx instead (it estimates a
# handful of rows there), whose entries include every row version this worker ever held RUNNING
# until vacuum removes them: beside an old snapshot (a forgotten transaction) none can be removed,
# and each finish and heartbeat read all of them (2,600 blocks after 60,000 tasks, growing). Inside
# COALESCE neither the partial indexes' predicate nor the holder column is visible to the planner.
_HELD = "COALESCE(t.holder = %(worker)s AND t.status = 'RUNNING', false)"

# A suspect's attempt is marked before its handler runs (one statement, by the executor).
START_SQL = f"""
UPDATE tasks_task AS t SET {_START_SET},
    attempt_isolated = %(isolated)s::boolean
FROM {_STARTS}
WHERE t.id = d.id AND t.token = d.token AND {_HELD}
  AND t.expires_at > clock_timestamp()
RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
"""

# A rate-limited attempt's start (tasks/lifecycle/ratelimits.py): ONE statement takes a start of its
# rate key's sliding window and marks the attempt started at the grant's clock, or, when the key cannot
# give it a start now, hands the attempt back uncharged (invariant 10: no attempt, no crash, no unstarted
# return) with run_after pushed to when its start is due. Sent by the executor right before the handler
# runs (as START_SQL for a suspect), so a start is counted when a handler really begins, not when a
# worker prefetches a claim; a claim that never started never took one.
#
# - ``mine`` locks the task row first (held by this worker, this token, a live lease): a lapsed claim
#   takes nothing; one already started (the reply to the first copy was lost) takes nothing again.
#   The lock order is always task row, then key row. A task without a rate key of its own takes its
#   queue's (``key``, ``limit``, ``period``: LEASING_TASKS["RATE_LIMITS"] as the worker has it).
# - ``slot`` is an upsert on the key's primary key (one row, one index probe; the first start of a
#   key inserts it). The SET is one sub-SELECT so that one clock reading, taken under the key row's
#   lock, decides and is recorded: grants of a key are serialised by that lock, so their times only
#   grow, and a grant needs fewer than ``max_starts`` recorded grants newer than now - period. Then
#   every window [w, w + period) holds at most max_starts grants: the last of them to be granted
#   counted all the others. ``starts`` keeps only the grants inside the window (at most max_starts,
#   oldest first), so the row stays small and the cost is O(max_starts), whatever the number of keys
#   or tasks. Strict by construction: no burst allowance (a token bucket with a burst of N lets 2N
#   starts into one window).
# - The key's refused tasks wait in line, in the order they were first refused, and nothing passes
#   them (issue 38: a backlog's first hundred tasks started in the last seconds of its drain).
#   * A task never refused (``rate_refusals`` 0) takes a free start only while nobody waits
#     (``line_open``): else it joins the back of the line, ``next_due``, the key's reservation tail,
#     which moves on by period / max_starts per refusal, so a backlog waits at distinct times at the
#     key's rate instead of coming due all at once (a claim's range scan is ``run_after <= now``:
#     deferred rows cost claims nothing).
#   * A task back from the line takes a free start. If none is free yet (its reservation came early:
#     the grants before it ran late), it keeps its place: it is given the next start the window frees
#     after the last one promised to a task back from the line (``promised_until``), exact while the
#     window holds the grant that frees it, else a step after the last promise. Sending such a task to
#     the back of the line again (once a quick retry missed) reshuffled the line: 4.97 refusals per
#     start, and a backlog's first tasks started last.
# - The tail is ``next_due``, but not far past the latest live reservation of a task with this key of its
#   own (tasks_task_rate_line_idx, read backwards from the end: one entry while the line is live): a
#   backlog cancelled or deleted, or a limit raised, leaves ``next_due`` far ahead with nobody in line,
#   and new refusals would queue after reservations nobody holds while the window stands empty (breaker
#   32: 58 s instead of 2). That read is the statement's snapshot, taken before it waited for the key
#   row: the refusals committed meanwhile (one per start in flight, under a window's worth) are not in
#   it, so the bound leaves them a period; a bound of one step gave several refusals of a burst the
#   same reservation, and their tasks came back together to one free start. Queue-wide keys (no rate
#   key on the row) keep ``next_due``.
# - A keyed task (concurrency) refused waits BLOCKED, giving its concurrency slot up while it waits.
_RATE_WINDOW = "make_interval(secs => excluded.period)"
_RATE_STEP = "make_interval(secs => excluded.period / excluded.max_starts)"
_RATE_TAIL = f"""CASE WHEN (SELECT m.queue_wide FROM mine AS m) THEN k.next_due ELSE LEAST(k.next_due, COALESCE(
                   (SELECT r.run_after FROM tasks_task AS r
                    WHERE r.rate_key = excluded.key AND r.status IN ('READY', 'BLOCKED') AND r.run_after > c.now
                    ORDER BY r.run_after DESC LIMIT 1) + {_RATE_WINDOW} + {_RATE_STEP},
                   '-infinity')) END"""
RATE_START_SQL = f"""
WITH mine AS MATERIALIZED (
    SELECT t.id, COALESCE(t.rate_key, %(key)s::text) AS rate_key,
           CASE WHEN t.rate_key IS NULL THEN %(limit)s::int ELSE t.rate_limit END AS rate_limit,
           CASE WHEN t.rate_key IS NULL THEN %(period)s::float8 ELSE t.rate_period END AS rate_period,
           t.rate_refusals > 0 AS in_line, t.attempt_started, t.rate_key IS NULL AS queue_wide
    FROM tasks_task AS t
    WHERE t.id = %(id)s::bigint AND t.token = %(token)s::bigint AND {_HELD} AND t.expires_at > clock_timestamp()
      AND COALESCE(t.rate_key, %(key)s::text) IS NOT NULL
    FOR NO KEY UPDATE OF t
), slot AS (
    INSERT INTO tasks_ratelimit AS k (key, max_starts, period, starts, next_due, grants, refusals, retry_at,
                                      promised_until, decided_at, granted)
    SELECT m.rate_key, m.rate_limit, m.rate_period, ARRAY[c.now], c.now, 1, 0, NULL, NULL, c.now, true
    FROM mine AS m, (SELECT clock_timestamp() AS now) AS c WHERE NOT m.attempt_started
    ON CONFLICT (key) DO UPDATE SET (max_starts, period, starts, next_due, grants, refusals, retry_at,
                                     promised_until, decided_at, granted) = (
        SELECT excluded.max_starts, excluded.period,
               CASE WHEN d.granted THEN w.kept || c.now ELSE w.kept END,
               CASE WHEN d.granted OR l.in_line THEN k.next_due ELSE d.sent_to + {_RATE_STEP} END,
               k.grants + d.granted::int,
               k.refusals + (NOT d.granted)::int,
               CASE WHEN d.granted THEN k.retry_at ELSE d.sent_to END,
               CASE WHEN NOT d.granted AND l.in_line THEN d.sent_to ELSE k.promised_until END,
               c.now,
               d.granted
        FROM (SELECT clock_timestamp() AS now) AS c
        CROSS JOIN LATERAL (
            SELECT COALESCE(array_agg(s.at ORDER BY s.at), '{{}}') AS kept, count(*)::int AS n
            FROM unnest(k.starts) AS s(at) WHERE s.at > c.now - {_RATE_WINDOW}
        ) AS w
        CROSS JOIN LATERAL (
            SELECT w.n >= excluded.max_starts AS full,
                   w.kept[w.n - excluded.max_starts + 1] + {_RATE_WINDOW} AS frees,
                   (SELECT m.in_line FROM mine AS m) AS in_line,
                   {_RATE_TAIL} AS tail,
                   GREATEST(c.now, k.promised_until) AS promised
        ) AS l
        CROSS JOIN LATERAL (
            SELECT NOT l.full AND (l.in_line OR (l.tail <= c.now AND l.promised <= c.now)) AS granted,
                   CASE WHEN l.in_line
                        THEN COALESCE((SELECT min(s.at) + {_RATE_WINDOW} FROM unnest(w.kept) AS s(at)
                                       WHERE s.at + {_RATE_WINDOW} > l.promised),
                                      l.promised + {_RATE_STEP})
                        ELSE GREATEST(l.tail, CASE WHEN l.full THEN l.frees END, l.promised + {_RATE_STEP}) END
                       AS sent_to
        ) AS d
    )
    RETURNING k.granted, k.decided_at, k.retry_at
), started AS (
    UPDATE tasks_task AS t SET
        attempt_started = true,
        attempt_isolated = %(isolated)s::boolean,
        attempts = t.attempts + 1,
        started_at = COALESCE(t.started_at, s.decided_at),
        last_attempted_at = s.decided_at,
        worker_ids = t.worker_ids || jsonb_build_array(t.holder)
    FROM mine AS m, slot AS s
    WHERE t.id = m.id AND s.granted
    RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
), refused AS (
    UPDATE tasks_task AS t SET
        status = {_WAITING_STATUS},
        run_after = s.retry_at,
        rate_refusals = t.rate_refusals + 1,
        attempt_started = false,
        attempt_isolated = false,
        released_at = clock_timestamp(),
        expires_at = LEAST(t.expires_at, clock_timestamp())
    FROM mine AS m, slot AS s
    WHERE t.id = m.id AND NOT s.granted
    RETURNING t.id, t.token, t.run_after
)
SELECT true, id, token, attempts, started_at, last_attempted_at, NULL::float8 FROM started
UNION ALL  -- with the seconds until it is due: the worker looks for it then (it was not NOTIFYed)
SELECT false, id, token, NULL, NULL, run_after, EXTRACT(EPOCH FROM run_after - clock_timestamp())::float8 FROM refused
UNION ALL  -- sent again after a lost reply: the first copy granted it (nothing else starts a rate-limited claim)
SELECT true, t.id, t.token, t.attempts, t.started_at, t.last_attempted_at, NULL
FROM tasks_task AS t JOIN mine AS m ON t.id = m.id WHERE m.attempt_started
"""

# One statement renews every task the worker still holds, and records the worker as alive. Each row
# is a compare-and-set on holder + id + TOKEN: a stale client reusing a worker name renews nothing.
# Only the worker process's own beat (``record_worker``) writes its row: an API client's heartbeat,
# refused or not, must not wipe the worker's stats or revive a worker recorded as stopped.
HEARTBEAT_SQL = f"""
WITH mine AS (
    SELECT t.id FROM tasks_task AS t
    JOIN unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token) ON t.id = d.id AND t.token = d.token
    WHERE {_HELD} AND t.expires_at > clock_timestamp()
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
    WHERE {_HELD} AND t.expires_at > clock_timestamp()
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

CHECKPOINT_SQL = """
UPDATE tasks_task SET progress = %(progress)s::jsonb, progress_at = clock_timestamp()
WHERE id = %(id)s AND holder = %(worker)s AND token = %(token)s AND status = 'RUNNING'
  AND expires_at > clock_timestamp()
"""

_OWNED = f"t.id = d.id AND t.token = d.token AND {_HELD}"
_LIVE = "t.expires_at > clock_timestamp()"

_COMPLETE_SET = f"""{_START_SET},
    status = 'SUCCESSFUL',
    return_value = d.return_value,
    finished_at = clock_timestamp(),
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())"""

COMPLETE_SQL = f"""
UPDATE tasks_task AS t SET {_COMPLETE_SET}
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(values)s::jsonb[], %(started)s::float8[])
         AS d(id, token, return_value, at)
WHERE {_OWNED} AND {_LIVE}
RETURNING t.id, t.token
"""

# The dispatcher's steady state in ONE statement (one round trip, one commit): finish the attempts
# that completed, mark the ones that began, claim the next batch. The CTEs touch disjoint rows
# (finished and started are distinct attempts of ours; claimed rows are READY), and every row of
# ours is guarded by holder + token + RUNNING + live lease. Rows come back tagged: 'c' claimed (the
# claim's columns), 'f' finished, 's' started (its times placed in the timestamp columns).
_FINISHED_CTE = f"""finished AS (
    UPDATE tasks_task AS t SET {_COMPLETE_SET}
    FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(values)s::jsonb[], %(started)s::float8[])
         AS d(id, token, return_value, at)
    WHERE {_OWNED} AND {_LIVE}
    RETURNING t.id, t.token
)"""


def _claimed_cte(pick: str, returning: str = CLAIM_RETURNING) -> str:
    return f"""claimed AS (
    UPDATE tasks_task AS t SET {_CLAIM_SET}
    {pick}
    RETURNING {returning}
)"""


# A fair claim's three more columns (its key, the cursor, taken by its key's turn), NULL in the other rows.
_FAIR_NULLS = ", NULL, NULL, NULL"


def _claimed_and_finished(fair: bool) -> str:
    return f"""SELECT 'c', claimed.* FROM claimed
UNION ALL
SELECT 'f', finished.id, finished.token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL{_FAIR_NULLS if fair else ""}
FROM finished"""


def _with(fair: bool) -> str:
    """The statement's WITH: a fair claim's CTEs (recursive) come first, after ``finished``."""
    return f"WITH RECURSIVE {_FINISHED_CTE}, {_FAIR_CTES}," if fair else f"WITH {_FINISHED_CTE},"


# What the worker hands to its executors with this round (tasks/worker/handoff.py), named on its own
# row before any of it can start: ``handed``, the attempts handed earlier whose start is not on their
# row yet and those handed now, followed by the first ``release`` of this claim's rows whose start is
# lazy (in the order the worker routes them: priority, id). A suspect's or a rate-limited task's start
# is its own statement, sent before its handler runs (START_SQL, RATE_START_SQL): never named.
# Recovery counts a RUNNING attempt whose token its holder's row names as one that may have run
# (invariant 14, _HANDED). One primary-key update of one row per round (``hand`` false: no write),
# not one per task: the marker of a short task still rides on its finish. ``handed`` is sent as the
# array's text ('{1,2}'): psycopg's dump of a list of a hundred ints costs the dispatcher 0.1 ms a
# round (the thread a one-process drain waits on), joining them 0.02 ms.
_HANDING_CTE = """handing AS (
    UPDATE tasks_worker SET handed = %(handed)s::text::bigint[] || ARRAY(
        SELECT c.token FROM claimed AS c
        WHERE NOT c.suspect AND c.rate_key IS NULL AND c.queue <> ALL(%(rated_queues)s::text[])
        ORDER BY c.priority DESC, c.id
        LIMIT %(release)s)
    WHERE id = %(worker)s::text AND %(hand)s::boolean
)"""


# The usual round (a short task's start rides on its finish): no marker arrays to send.
def _finish_and_claim_sql(pick: str, fair: bool = False) -> str:
    returning = FAIR_CLAIM_RETURNING if fair else CLAIM_RETURNING
    return f"""
{_with(fair)} {_claimed_cte(pick, returning)}, {_HANDING_CTE}
{_claimed_and_finished(fair)}
"""


def _finish_start_claim_sql(pick: str, fair: bool = False) -> str:
    returning = FAIR_CLAIM_RETURNING if fair else CLAIM_RETURNING
    return f"""
{_with(fair)} started AS (
    UPDATE tasks_task AS t SET {_START_SET}
    FROM {_STARTS}
    WHERE {_OWNED} AND {_LIVE}
    RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
), {_claimed_cte(pick, returning)}, {_HANDING_CTE}
{_claimed_and_finished(fair)}
UNION ALL
SELECT 's', started.id, started.token, NULL, NULL, NULL, started.attempts, NULL, NULL,
       started.started_at, NULL, NULL, NULL, started.last_attempted_at, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL{_FAIR_NULLS if fair else ""}
FROM started
"""


# The claim of chosen tasks, for tasks.testing's eager mode: an enqueue runs what it inserted at once,
# in the caller's transaction. It takes the READY rows among ``ids`` and the members of ``workflows``
# (a workflow step a finished one released), best first, whatever their ``run_after`` (a deferred task
# runs at once, a failed attempt is retried without its backoff), but not a task its handler snoozed
# until later (it would be run again and again) nor one of a paused queue. Test-sized sets: it reads
# the primary key and tasks_task_workflow_idx, never the claim index the workers share.
CLAIM_CHOSEN_SQL = f"""
UPDATE tasks_task AS t SET {_CLAIM_SET}
WHERE t.id = ANY(ARRAY(
    SELECT c.id FROM tasks_task AS c
    WHERE (c.id = ANY(%(ids)s::bigint[]) OR c.workflow_id = ANY(%(workflows)s::bigint[]))
      AND c.status = 'READY' AND (c.snoozed_at IS NULL OR c.run_after <= statement_timestamp())
      AND NOT EXISTS (SELECT 1 FROM tasks_queuecontrol AS q WHERE q.name = c.queue AND q.paused)
    ORDER BY c.priority DESC, c.run_after, c.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))
RETURNING {CLAIM_RETURNING}
"""

# Each claiming statement in two forms, indexed by "claims from several queues".
CLAIM_SQL = (_claim_sql(_PICK_ONE), _claim_sql(_PICK_MANY))
FINISH_AND_CLAIM_SQL = (_finish_and_claim_sql(_PICK_ONE), _finish_and_claim_sql(_PICK_MANY))
FINISH_START_CLAIM_SQL = (_finish_start_claim_sql(_PICK_ONE), _finish_start_claim_sql(_PICK_MANY))
# The same from one fair queue (_FAIR_CTES, _PICK_FAIR): each row's fair_key and the cursor come back last.
FAIR_CLAIM_SQL = _claim_sql(_PICK_FAIR, FAIR_CLAIM_RETURNING, _FAIR_CTES)
FAIR_FINISH_AND_CLAIM_SQL = _finish_and_claim_sql(_PICK_FAIR, fair=True)
FAIR_FINISH_START_CLAIM_SQL = _finish_start_claim_sql(_PICK_FAIR, fair=True)

# The error history is bounded: a task failing, crashing or being requeued forever must not grow a
# row without end (40 requeues of a 100 KB traceback made a 4.4 MB row). The first entry (how it
# started to go wrong) and the newest MAX_ERRORS - 1 are kept; each entry dropped to make room is
# counted in ``errors_dropped``. The newest entry stays last (``errors -> -1`` is how a worker whose
# reply was lost tells that its write landed).
MAX_ERRORS = 10
_ERRORS_FULL = f"(jsonb_array_length(t.errors) >= {MAX_ERRORS})"


def _append_error(entry: str) -> str:
    """SET items appending ``entry`` (a jsonb object expression) to ``errors``, capped."""
    return f"""errors = CASE WHEN {_ERRORS_FULL} THEN (t.errors - 1) ELSE t.errors END || jsonb_build_array({entry}),
    errors_dropped = t.errors_dropped + {_ERRORS_FULL}::int"""


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
_RETRYABLE = "(d.kind = 'fail' AND d.retry AND t.failures + 1 < COALESCE(d.max_attempts, t.max_attempts))"
_WAITS = f"({_SNOOZE} OR {_RETRYABLE})"


# A failed attempt is the handler's own outcome: it costs one of ``max_attempts``. The error entry
# carries the attempt's token so a worker whose reply was lost can tell that this write landed.
FAIL_SQL = f"""
UPDATE tasks_task AS t SET
    status = CASE WHEN {_WAITS} THEN {_WAITING_STATUS} WHEN d.kind = 'cancel' THEN 'CANCELLED' ELSE 'FAILED' END,
    run_after = CASE WHEN {_SNOOZE} THEN clock_timestamp() + make_interval(secs => COALESCE(d.delay, 0))
                     WHEN {_RETRYABLE} THEN clock_timestamp()
                          + COALESCE(make_interval(secs => d.delay), {_backoff_sql("t.failures")})
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
    started_at = COALESCE(t.started_at, clock_timestamp()),
    last_attempted_at = CASE WHEN t.attempt_started THEN t.last_attempted_at ELSE clock_timestamp() END,
    worker_ids = CASE WHEN {_SNOOZE} THEN (CASE WHEN t.attempt_started THEN t.worker_ids - (-1) ELSE t.worker_ids END)
                      WHEN t.attempt_started THEN t.worker_ids ELSE t.worker_ids || jsonb_build_array(t.holder) END,
    errors = CASE WHEN {_SNOOZE} THEN t.errors
                  ELSE CASE WHEN {_ERRORS_FULL} THEN (t.errors - 1) ELSE t.errors END || jsonb_build_array(
        d.error || jsonb_build_object(
        'attempt', t.attempts + (NOT t.attempt_started)::int, 'worker', t.holder, 'token', t.token,
        'kind', CASE WHEN d.kind = 'cancel' THEN 'cancel' ELSE 'failure' END, 'at', clock_timestamp())) END,
    errors_dropped = t.errors_dropped + (NOT {_SNOOZE} AND {_ERRORS_FULL})::int,
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(errors)s::jsonb[], %(retry)s::boolean[], %(kinds)s::text[],
            %(delays)s::float8[], %(max_attempts)s::int[])
     AS d(id, token, error, retry, kind, delay, max_attempts)
WHERE {_OWNED} AND {_LIVE}
RETURNING t.id, t.status, t.run_after,
          -- how long until it is due again, on the database clock (the worker's log says it)
          EXTRACT(EPOCH FROM t.run_after - clock_timestamp())::float8
"""

# Hand-back (graceful shutdown, or claims the worker cannot run): runnable again at once, keeping its
# place. Nothing is charged. An interrupted attempt that had started stays counted in ``attempts``
# (it did begin; ``worker_ids`` names it) and gets an error entry saying why it ended.
HAND_BACK_SQL = f"""
UPDATE tasks_task AS t SET
    status = 'READY',
    run_after = LEAST(t.run_after, clock_timestamp()),
    attempt_started = false,
    attempt_isolated = false,
    errors = CASE WHEN NOT t.attempt_started THEN t.errors
                  WHEN {_ERRORS_FULL} THEN t.errors - 1 ELSE t.errors END
        || CASE WHEN t.attempt_started THEN jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts, 'worker', t.holder, 'token', t.token, 'kind', 'shutdown', 'at', clock_timestamp(),
        'exception_class_path', 'tasks.exceptions.WorkerShutdown',
        'message', %(reason)s::text, 'traceback', '')) ELSE '[]'::jsonb END,
    errors_dropped = t.errors_dropped + (t.attempt_started AND {_ERRORS_FULL})::int,
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token)
WHERE {_OWNED}
RETURNING t.id, t.token
"""

# An operator's delete (the admin; TaskQuerySet.delete_finished): the rows named go only if every one
# of them is finished. One that is not (a RUNNING attempt, a task still waiting) refuses the whole
# delete and changes nothing (invariant 12): no transition deletes an unfinished row, whose worker, key
# slot or dependants would wait for it. ``picked`` locks the rows first, in id order (FOR UPDATE: a
# requeue or claim committing meanwhile is read as it committed), so the check and the DELETE see the
# same statuses; the refused rows come back with their statuses, for the message.
DELETE_FINISHED_SQL = """
WITH picked AS MATERIALIZED (
    SELECT t.id, t.status FROM tasks_task AS t
    WHERE t.id = ANY(%(ids)s::bigint[])
    ORDER BY t.id
    FOR UPDATE
), deleted AS (
    DELETE FROM tasks_task AS t USING picked AS p
    WHERE t.id = p.id
      AND NOT EXISTS (SELECT 1 FROM picked AS u WHERE u.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))
    RETURNING t.id
)
SELECT true, id, NULL::text FROM deleted
UNION ALL
SELECT false, id, status FROM picked WHERE status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
"""

_NO_LEASE = "(t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)"
# Handed to an executor by its worker (the ``handed`` CTE of RECOVER_CTES: its holder's row names its
# token) while its start marker had not committed: it may have run, so it counts as begun (invariant 14).
_HANDED = f"(handed.id IS NOT NULL AND NOT t.attempt_started AND NOT {_NO_LEASE})"
_STARTED = f"((t.attempt_started OR {_HANDED}) AND NOT {_NO_LEASE})"
# Whose fault was it? The worker's heartbeat renews every attempt it holds and stamps its own row
# (last_seen_at, and the beat before it in previous_seen_at) in the same statement. If the SAME
# incarnation of the worker (started before this claim) stamped its row between this attempt's last
# renewal (+ ttl/6 margin: beats are ttl/3 apart) and its expiry, the worker lived on without renewing
# this attempt: the attempt itself stalled, and the crash is the task's. Stamps after the expiry do
# not count (a frozen worker that thaws before recovery runs, or a restart under the same id). An
# attempt that ran isolated (nothing else in its process, abandoned threads included) is the task's
# too. Otherwise the worker vanished with several attempts in it and nobody can tell which one killed
# it: a *shared* crash, charged to no one; after ISOLATE_AFTER of them the task runs isolated.
_WORKER_OUTLIVED = """EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at))"""
_ATTRIBUTABLE = f"(t.attempt_isolated OR {_WORKER_OUTLIVED})"


def _stalled_in_live_worker(alias: str, last_renewed: str) -> str:
    """The attempt's worker has not stopped and stamped its row after the attempt's last renewal (plus
    the beats' margin): it lived on, so the attempt's handler may still be running there."""
    return f"""EXISTS (
        SELECT 1 FROM tasks_worker AS w
        WHERE w.id = {alias}.holder AND w.stopped_at IS NULL
          AND w.last_seen_at > {last_renewed} + make_interval(secs => w.ttl / 6))"""


_CRASHED = f"({_STARTED} AND {_ATTRIBUTABLE})"
_SHARED = f"({_STARTED} AND NOT {_ATTRIBUTABLE})"
_STILL_ALLOWED = f"(NOT {_CRASHED} OR t.crashes + 1 < %(max_crashes)s)"
# A keyed attempt that stalled while its worker lived on keeps its key slot for its handler (the kept
# CTE of RECOVER_CTES), so the task gives up the slot of its row and waits BLOCKED: it runs again
# when the key has room, never beside its own stalled handler.
_KEEPS_SLOT = (
    f"(t.concurrency_key IS NOT NULL AND {_CRASHED}"
    f" AND {_stalled_in_live_worker('t', 'COALESCE(t.renewed_at, t.acquired_at)')})"
)

_RECOVERY_ENTRY = f"""jsonb_build_object(
        'attempt', t.attempts + {_HANDED}::int, 'worker', t.holder, 'token', t.token, 'at', clock_timestamp(),
        'kind', CASE WHEN {_CRASHED} THEN 'crash' WHEN {_SHARED} THEN 'vanished' WHEN {_NO_LEASE} THEN 'orphan'
                     ELSE 'returned' END,
        'exception_class_path', 'tasks.exceptions.TaskLeaseLost',
        'message', CASE WHEN {_CRASHED} THEN 'lease expired: the attempt stalled or killed its worker (charged)'
                        WHEN {_SHARED} THEN 'lease expired: its worker vanished with other attempts (not charged)'
                        WHEN {_NO_LEASE} THEN 'orphan: running without a lease; repaired by recovery'
                        ELSE 'lease expired before the attempt was known to start: returned uncharged' END,
        'traceback', '',
        'expired_at', t.expires_at,
        'recovery_delay', EXTRACT(EPOCH FROM clock_timestamp() - t.expires_at),
        'silent_for', EXTRACT(EPOCH FROM clock_timestamp() - COALESCE(t.renewed_at, t.acquired_at)))"""

# Requeue tasks whose lease expired (their worker died or stalled) and running rows without a lease
# (impossible states, repaired). An attempt that never started goes back uncharged, keeping its place;
# so does a shared crash (the first keeps its place: a crash is rarely the task's fault, and behind a
# long backlog "runnable again" would otherwise mean "runs minutes later"). From ISOLATE_AFTER shared
# crashes on, the task runs isolated, so its next crash is attributable. Attributable crashes back
# off after the first and after MAX_CRASHES the task is FAILED: a poison pill stops killing workers.
# One statement per batch; a row's classification is read under its row lock. A keyed attempt that
# stalled in a worker that lived on (charged as a crash, its worker stamped its row after the attempt's
# last renewal and has not stopped) may still be running its handler: its key slot is kept in
# tasks_concurrencyhold by the same statement, so the admission this requeue triggers (at the end of
# the statement, seeing the insert) does not hand the slot on (tasks/lifecycle/concurrency.py).
# The statement's CTEs apart, so that activity.py's recording statement can add its own beside them
# (a data-modifying CTE must be at the top level of a statement).
#
# An attempt its worker had handed to an executor counts as started even if its marker never
# committed (invariant 14; tasks/worker/handoff.py): its start is charged here (``attempts``,
# ``worker_ids``; its times no earlier than its claim) and its end is a crash like any started
# attempt's. ``handed`` reads the holder's row with a lock (FOR KEY SHARE: it waits for no update of
# the worker's, which take no key lock), so it reads the newest committed names rather than the
# statement's snapshot: a round committed after that snapshot may have handed the attempt over. A
# round not committed yet has handed nothing: once it commits, the executor finds the lease gone (the
# worker's local deadline comes before the expiry recovery saw) and gives the claim back.
#
# Two picks. The full one reads every entry of tasks_task_running_exp_idx up to now, and finds the
# impossible states (no lease, no holder). Beside an old snapshot every RUNNING version a task ever
# had keeps its entry there (its expires_at long past), so that scan steps over the whole history
# since the snapshot. The windowed one (``after``: the database time of the last scan's start, less
# RECOVERY_MARGIN) reads only the leases that expired since: a range of the index, as long as the
# leases that ended in it, whatever the history. The recovery leader runs it between full scans
# (tasks/maintenance/recovery.py, RecoveryWindow).
_PICK_EXPIRED = """
    WHERE status = 'RUNNING'
      AND (expires_at <= clock_timestamp() OR expires_at IS NULL OR holder IS NULL OR token IS NULL)
    ORDER BY expires_at NULLS FIRST"""
_PICK_EXPIRED_SINCE = """
    WHERE status = 'RUNNING' AND expires_at > %(after)s::timestamptz AND expires_at <= clock_timestamp()
    ORDER BY expires_at"""


def _recover_ctes(pick: str) -> str:
    return f"""
picked AS MATERIALIZED (
    SELECT id, expires_at, holder, token FROM tasks_task{pick}
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), handed AS MATERIALIZED (
    SELECT p.id FROM picked AS p JOIN tasks_worker AS w ON w.id = p.holder
    WHERE p.token = ANY(w.handed)
    FOR KEY SHARE OF w
), recovered AS (
UPDATE tasks_task AS t SET
    status = CASE WHEN NOT {_STILL_ALLOWED} THEN 'FAILED'
                  WHEN {_CRASHED} AND t.crashes > 0 THEN {_WAITING_STATUS}  -- backs off
                  WHEN {_KEEPS_SLOT} THEN 'BLOCKED'  -- its stalled handler keeps the slot
                  ELSE 'READY' END,
    run_after = CASE WHEN NOT {_STILL_ALLOWED} OR NOT {_CRASHED} OR t.crashes = 0
                     THEN LEAST(t.run_after, clock_timestamp())
                     ELSE clock_timestamp() + {_backoff_sql("t.crashes - 1")} END,
    finished_at = CASE WHEN {_STILL_ALLOWED} THEN NULL ELSE clock_timestamp() END,
    crashes = t.crashes + {_CRASHED}::int,
    shared_crashes = t.shared_crashes + {_SHARED}::int,
    unstarted_returns = t.unstarted_returns + (NOT {_STARTED} AND NOT {_NO_LEASE})::int,
    attempts = t.attempts + {_HANDED}::int,
    worker_ids = CASE WHEN {_HANDED} THEN t.worker_ids || jsonb_build_array(t.holder) ELSE t.worker_ids END,
    started_at = CASE WHEN {_HANDED} THEN COALESCE(t.started_at, t.acquired_at) ELSE t.started_at END,
    last_attempted_at = CASE WHEN {_HANDED} THEN t.acquired_at ELSE t.last_attempted_at END,
    attempt_started = false,
    attempt_isolated = false,
    {_append_error(_RECOVERY_ENTRY)},
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM picked LEFT JOIN handed ON handed.id = picked.id
WHERE t.id = picked.id
RETURNING t.id, t.status, EXTRACT(EPOCH FROM clock_timestamp() - picked.expires_at)::float8 AS expired_for,
          -- a grant is recovered at most once: a last error entry with this token was just added
          t.errors -> -1 ->> 'kind' AS kind,
          t.concurrency_key, t.token, t.holder, COALESCE(t.renewed_at, t.acquired_at) AS last_renewed,
          t.queue, t.attempts  -- with the holder: the fields of recovery's log record about the task
), kept AS (
    INSERT INTO tasks_concurrencyhold (key, task_id, token, worker, reason)
    SELECT r.concurrency_key, r.id, r.token, r.holder, 'lapsed' FROM recovered AS r
    WHERE r.concurrency_key IS NOT NULL AND r.kind = 'crash' AND {_stalled_in_live_worker("r", "r.last_renewed")}
    ON CONFLICT DO NOTHING
)"""


RECOVER_CTES = _recover_ctes(_PICK_EXPIRED)
RECOVER_SINCE_CTES = _recover_ctes(_PICK_EXPIRED_SINCE)

RECOVER_SQL = f"""
WITH {RECOVER_CTES}
SELECT id, status, expired_for, kind, queue, attempts, holder FROM recovered
"""

# A lease left live on a row that is not running (it can only come from hand edits or a bug):
# release it, so the lease state querysets and the dashboard stay truthful.
RELEASE_STRAY_LEASES_SQL = """
UPDATE tasks_task SET released_at = clock_timestamp(), expires_at = LEAST(expires_at, clock_timestamp())
WHERE status <> 'RUNNING' AND released_at IS NULL AND expires_at IS NOT NULL
RETURNING id
"""

# Running tasks held by a worker that has already said it stopped (or was found dead): it will never
# heartbeat or finish them, so there is no reason to wait for the TTL. Expire them now; recovery
# requeues them.
# Only workers that stopped within twice their TTL: an older one's leases have all expired (its last
# renewal was before it stopped), and recovery's own pick takes those. Its rows are found by their
# live leases (expires_at still ahead: tasks_task_running_exp_idx) with the holder test hidden from
# the planner: beside an old snapshot tasks_task_running_holder_idx keeps every RUNNING version the
# stopped worker ever had.
EXPIRE_ORPHANS_SQL = """
UPDATE tasks_task AS t SET expires_at = clock_timestamp()
FROM tasks_worker AS w
WHERE t.status = 'RUNNING' AND t.expires_at > clock_timestamp() AND COALESCE(t.holder, '') = w.id
  AND w.stopped_at IS NOT NULL AND w.stopped_at > clock_timestamp() - make_interval(secs => 2 * w.ttl)
RETURNING t.id
"""

# Workers that have not been seen for more than twice their own TTL are dead (SIGKILL, power loss):
# say so, with the reason, so the workers page does not fill with ghosts that look alive.
MARK_DEAD_WORKERS_SQL = """
UPDATE tasks_worker SET
    stopped_at = clock_timestamp(),
    stop_reason = format('presumed dead: silent for %%ss (more than twice its %%ss TTL)',
                         round(EXTRACT(EPOCH FROM clock_timestamp() - last_seen_at)::numeric, 1), ttl)
WHERE stopped_at IS NULL AND last_seen_at < clock_timestamp() - make_interval(secs => 2 * ttl)
RETURNING id
"""

# After a connection error the worker cannot know whether its last statement committed. It asks:
# what does the database say it holds under its id, and where did the attempts it was finishing end?
HELD_SQL = """
SELECT id, token, attempt_started FROM tasks_task WHERE holder = %(worker)s AND status = 'RUNNING'
"""

ATTEMPT_FATE_SQL = """
SELECT t.id, t.token, t.holder, t.status, t.errors -> -1 ->> 'token', t.errors -> -1 ->> 'kind',
       -- a snooze leaves no error entry: it landed if the row snoozed after this claim's grant
       COALESCE(t.snoozed_at >= t.acquired_at, false)
FROM tasks_task AS t
WHERE t.id = ANY(%(ids)s::bigint[])
"""
