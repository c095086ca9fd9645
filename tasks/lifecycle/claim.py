"""Claim: a worker (or an API client) takes due READY tasks under a lease, ``FOR UPDATE SKIP LOCKED``:
from one queue or several (``CLAIM_SQL``, indexed by "several"), from a fair queue taking turns between
its keys (``FAIR_CLAIM_SQL``), or the chosen ones of tasks.testing's eager mode (``CLAIM_CHOSEN_SQL``).
The picks and the claim's SET are shared with the dispatcher's round statements (tasks/lifecycle/rounds.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from leasing.models import GRANT_SET
from tasks.lifecycle.fragments import CLAIM_RETURNING
from tasks.lifecycle.values import ClaimPosition, FairPosition, FairPositions, fair_positions_json

# ``%(start)s`` is false for a worker's claim (the start marker follows when an executor begins the
# task) and true for an HTTP client's claim, which begins the attempt as it returns; but not a task
# with a rate key: its start must be granted by RATE_START_SQL, which the API sends next.
_STARTS_NOW = "(%(start)s::boolean AND t.rate_key IS NULL)"
CLAIM_SET = f"""
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

# The plain claim (the whole why: docs/explanation/claims.md, "The plain claim"). The pick reads the
# partial index tasks_task_claim_idx (queue, priority DESC, run_after, id, shared_crashes) WHERE READY
# and locks with SKIP LOCKED, so it reads only its own queue's runnable rows. It walks the queue's
# priorities itself (``levels``: one index probe per priority, a manual skip scan) and range-scans
# each level's due rows, so deferred rows cost nothing on any PostgreSQL major. The pick runs once
# per statement (an InitPlan, or a MATERIALIZED CTE: tests/db/test_pick_once.py). A paused queue gives
# nothing; a task that must run isolated goes only to an idle worker (``isolation_bar``). While its
# claims come back full, a worker resumes after its last claimed position per queue and level (the
# ``after_*`` arrays), so an old snapshot's unremovable entries are not stepped over again; it scans
# from the start after a short claim and at least every RESCAN_INTERVAL.
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


# A queue's priority levels that have due rows, highest first (none while the queue is paused), each
# with where its scan starts (``placed``): the plain claim's walk, and the fair claim's fill.
_LEVELS = f"""levels(priority) AS (
        SELECT {_next_level("32767")}
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT {_next_level("levels.priority")}
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.priority, {_start("%(queue)s")} FROM levels AS l
    )"""

# One queue: the ``levels`` walk, then each level's due rows after its start, locking as it goes,
# all inside ARRAY(...): an uncorrelated InitPlan, run once per statement. Joined as a subquery it may
# run again for every row of the outer table, each run locking the next rows (a claim of 5 took a
# queue's every task: tests/db/test_pick_once.py; docs/explanation/claims.md, "A pick runs once").
PICK_ONE = f"""
WHERE t.id = ANY(ARRAY(
    WITH RECURSIVE {_LEVELS}
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
PICK_MANY = f"""
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

# Fair queues (LEASING_TASKS["FAIR_QUEUES"]; the whole why: docs/explanation/claims.md, "The fair
# claim"). A claim takes turns between the queue's keys over tasks_task_fair_idx (queue, fair_key,
# priority DESC, run_after, id). ``walk``: the keys with due rows, in key order after FAIR_CURSOR, one
# index probe per key, at most _WALK_KEYS visited (bounded by the claim's limit, never by keys or
# rows). ``fair``: each walked key's due rows up to its quota (the limit dealt round the keys), its
# own priorities walked level by level. The fill: the plain pick takes the room left, so a claim is
# never short while due rows are left. Beside an old snapshot, each key's turn, the fill and the walk
# resume after the claimer's positions, as the plain claim does.
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
# blocks in its pick (8 per turn and 64: 893); an attack's 100 such tenants beside a backlog and
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
FAIR_CTES = f"""walk(fair_key, due, wrapped, n, keys) AS (
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
    ), {_LEVELS}"""

PICK_FAIR = """
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
# key every life. Off the hot path: a claimer reads it once, when it starts claiming
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
# The write never waits. An API claim writes inside its request's transaction and holds
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
UPDATE tasks_task AS t SET {CLAIM_SET}
{pick}
RETURNING {returning}
"""


# The claim of chosen tasks, for tasks.testing's eager mode: an enqueue runs what it inserted at once,
# in the caller's transaction. It takes the READY rows among ``ids`` and the members of ``workflows``
# (a workflow step a finished one released), best first, whatever their ``run_after`` (a deferred task
# runs at once, a failed attempt is retried without its backoff), but not a task its handler snoozed
# until later (it would be run again and again) nor one of a paused queue. Test-sized sets: it reads
# the primary key and tasks_task_workflow_idx, never the claim index the workers share.
CLAIM_CHOSEN_SQL = f"""
UPDATE tasks_task AS t SET {CLAIM_SET}
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
CLAIM_SQL = (_claim_sql(PICK_ONE), _claim_sql(PICK_MANY))
# The same from one fair queue (FAIR_CTES, PICK_FAIR): each row's fair_key and the cursor come back last.
FAIR_CLAIM_SQL = _claim_sql(PICK_FAIR, FAIR_CLAIM_RETURNING, FAIR_CTES)
