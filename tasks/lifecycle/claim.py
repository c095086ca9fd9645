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
# PICK_MANY (the shares and the locking) scan each level after its queue's position.
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


PICK_ONE = f"""
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
#   rest comes from the plain pick over tasks_task_claim_idx (the levels walk of PICK_ONE from
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
    ), levels(priority) AS (
        SELECT {_next_level("32767")}
        WHERE NOT EXISTS (SELECT 1 FROM tasks_queuecontrol WHERE name = %(queue)s AND paused)
        UNION ALL
        SELECT {_next_level("levels.priority")}
        FROM levels WHERE levels.priority IS NOT NULL
    ), placed AS (
        SELECT l.priority, {_start("%(queue)s")} FROM levels AS l
    )"""

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
