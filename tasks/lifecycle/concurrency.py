"""Concurrency keys: at most ``concurrency_limit`` tasks with the same ``concurrency_key`` at once.

Design (gate at admission, not at claim). A keyed task enters READY only when its key has a free
slot; otherwise it waits BLOCKED. The database enforces it with triggers (migrations 0009 to 0012),
so every path obeys, the worker's statements and an operator's UPDATE alike:

- a keyed task that would become READY from outside its key (enqueue, requeue of a finished task,
  a retry or a crash backing off) becomes BLOCKED instead;
- once per statement, a statement trigger reads the rows the statement inserted, updated or deleted
  (its transition tables, set-based: linear in rows) and admits for each key in key order whose
  tasks were enqueued, freed a slot, started waiting or came due earlier (``retry_now``);
- admitting for a key takes the key's row in tasks_concurrencykey with SKIP LOCKED, counts the key's
  READY + RUNNING tasks from tasks_task (a snapshot taken after the lock, so every earlier admission
  is visible and none can race it) and moves the best due BLOCKED tasks into the free slots
  (priority, then run_after, then id).

So the claim does not change at all: BLOCKED tasks are not in the claim index, and a key with
100,000 waiting tasks costs the claim nothing. A slot is held from admission (READY) to the end of
the attempt, which is stricter than "RUNNING": at most ``limit`` tasks of a key are READY or RUNNING
at any instant on the database's clock. A hand-back and an uncharged recovery keep the slot (the task
is runnable at once); a retry or a crash that backs off gives it up and waits its turn again.

Conflicting limits: the key's limit is the one given by its most recent enqueue, the one with the
largest task id (it lives in tasks_concurrencykey.max_running, with that task's id). Lowering it
admits nothing new until the key is below it; raising it admits at once. A deduplicated enqueue,
which inserts nothing, changes nothing.

Nothing waits for a key. An application's open transaction that enqueued a task of the key holds
the key's row until it commits; an admission that finds the row held (a worker's finishing statement,
another enqueue) writes a note in tasks_concurrencywake (a plain insert) and goes on at once: a
locked key defers its own admission, never a statement's work for other keys. The next admission of
the key takes over the notes (and the latest limit they carry), and so does the recovery round's
sweep (:func:`admit_waiting`).

Deferred waiting tasks: each key keeps ``wake_at``, when its first waiting task that is not due yet
comes due, set by every admission while the key has a free slot (a full key needs none: the
statement that frees a slot admits). The sweep reads the keys due now through an index (and the
notes), so a due key is admitted within one recovery interval whatever the number of keys, and
however recovery runs (the worker's leader or ``recover_tasks --once`` from cron: no position kept
in memory).

Crashes need nothing special: a dead worker's RUNNING tasks hold their slots until recovery requeues
them (READY, slot kept) or fails them (slot freed, next task admitted), within TTL + recovery
interval. A release that races an admission is counted as still holding its slot (never more than
the limit) and the releasing statement admits for its key itself (or notes it).

Handlers that outlive their row. A limit means "at most N of the key's handlers running", and a row
can stop counting while its handler still runs: a timed-out attempt is recorded as failed at its
deadline but its thread cannot be stopped (a cancelled coroutine runs until its next await), and an
attempt whose lease lapsed while its worker lived on (it stalled) is requeued by recovery. Such an
attempt keeps its slot as a row of tasks_concurrencyhold, which the admission counts with the key's
READY and RUNNING tasks:

- the worker writes it (KEEP_SLOTS_SQL) when it abandons an attempt at its timeout, before the
  timeout is recorded; recovery writes it in the statement that requeues a lapsed attempt whose
  worker stamped its row after the attempt's last renewal (RECOVER_EXPIRED_SQL);
- the worker deletes it (RELEASE_KEPT_SQL) once the handler has returned; recovery deletes those of
  workers that stopped or were presumed dead (RELEASE_DEAD_SQL): a process known dead runs nothing.
  Deleting one admits for its key (a statement trigger, migration 0015).

An attempt whose worker vanished (no stamp since its last renewal) keeps nothing: it is requeued
within TTL + recovery interval as before (invariant 7); a frozen process that thaws later is fenced
out by its token. A handler that never returns keeps its slot until its process ends; the worker
stops itself once more than twice its concurrency of handlers are stuck, so that a supervisor
restarts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from leasing.routing import selected_database

#: Keys the recovery round's sweep admits for at most, per kind (skipped admissions, keys come due), per
#: statement; it repeats the statement until a batch comes back short or SWEEP_KEYS are done.
SWEEP_BATCH = 500
SWEEP_KEYS = 5000
#: Keys the dashboard and /metrics show at most.
SHOWN_KEYS = 50
#: Waiting tasks counted per key at most (shown as "10,000+").
WAITING_CAP = 10_000

# The recovery round's sweep (admit_waiting): a batch of the keys whose admission was skipped (their row
# was held) and of those whose first deferred task came due while a slot is free, read from an index.
SWEEP_SQL = "SELECT keys, admitted FROM tasks_concurrency_sweep(%(batch)s)"

# Admission for named keys, in key order (two sessions admitting the same keys take their locks in
# the same order): the number each admitted, never below 0.
ADMIT_SQL = """
SELECT k, greatest(tasks_concurrency_admit(k, NULL, NULL), 0) FROM unnest(%(keys)s::text[]) AS u(k) ORDER BY k
"""

# The keys worth showing: those with admitted tasks (a set bounded by the sum of the limits, read
# from tasks_task_slot_idx) and those with waiting tasks (a loose index scan, as above), the first
# ``limit`` of each by name. Per key: RUNNING and admitted counts (bounded by the limit), the
# waiting count, capped, and the slots kept for handlers that outlived their rows (a handful).
KEY_STATS_SQL = """
WITH RECURSIVE waiting(key) AS (
    (SELECT concurrency_key FROM tasks_task WHERE status = 'BLOCKED' ORDER BY concurrency_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.concurrency_key FROM tasks_task AS t
            WHERE t.status = 'BLOCKED' AND t.concurrency_key > waiting.key ORDER BY t.concurrency_key LIMIT 1)
    FROM waiting WHERE waiting.key IS NOT NULL
), admitted(key) AS (
    (SELECT concurrency_key FROM tasks_task
     WHERE status IN ('READY', 'RUNNING') AND concurrency_key IS NOT NULL ORDER BY concurrency_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.concurrency_key FROM tasks_task AS t
            WHERE t.status IN ('READY', 'RUNNING') AND t.concurrency_key IS NOT NULL
              AND t.concurrency_key > admitted.key
            ORDER BY t.concurrency_key LIMIT 1)
    FROM admitted WHERE admitted.key IS NOT NULL
), keys AS (
    (SELECT key FROM waiting WHERE key IS NOT NULL LIMIT %(limit)s)
    UNION
    (SELECT key FROM admitted WHERE key IS NOT NULL LIMIT %(limit)s)
)
SELECT keys.key, c.max_running,
       (SELECT count(*) FROM tasks_task AS t
        WHERE t.concurrency_key = keys.key AND t.status IN ('READY', 'RUNNING') AND t.status = 'RUNNING'),
       (SELECT count(*) FROM tasks_task AS t WHERE t.concurrency_key = keys.key AND t.status IN ('READY', 'RUNNING')),
       (SELECT count(*) FROM (SELECT 1 FROM tasks_task AS t WHERE t.status = 'BLOCKED' AND t.concurrency_key = keys.key
                              LIMIT %(cap)s + 1) AS w),
       (SELECT count(*) FROM tasks_concurrencyhold AS h WHERE h.key = keys.key)
FROM keys LEFT JOIN tasks_concurrencykey AS c ON c.key = keys.key
ORDER BY keys.key
"""


# A key's row holds nothing but its limit (and the lock): once none of its tasks is unfinished and
# no enqueue set its limit for IDLE_KEY_SECONDS, it is deleted, so per-customer keys do not pile up
# for months. Safe against a racing enqueue: that enqueue's admission inserts the row again with its
# own limit (the limit rule is "the latest enqueue's"), and a row is deleted only under its lock
# (SKIP LOCKED: a key being admitted right now is left for the next round).
PRUNE_IDLE_KEYS_SQL = """
DELETE FROM tasks_concurrencykey AS c
WHERE c.key = ANY(ARRAY(  -- run once (tasks/lifecycle/claim.py, PICK_ONE, says why)
    SELECT i.key FROM tasks_concurrencykey AS i
    WHERE i.updated_at < clock_timestamp() - make_interval(secs => %(idle)s)
      AND NOT EXISTS (SELECT 1 FROM tasks_task AS t
                      WHERE t.concurrency_key = i.key AND t.status IN ('READY', 'RUNNING'))
      AND NOT EXISTS (SELECT 1 FROM tasks_task AS t WHERE t.concurrency_key = i.key AND t.status = 'BLOCKED')
    ORDER BY i.updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))
RETURNING c.key
"""
#: A key's row is forgotten after this long without an enqueue and without unfinished tasks.
IDLE_KEY_SECONDS = 3600.0


def prune_idle_keys(*, using: str = DEFAULT_DB_ALIAS, idle: float = IDLE_KEY_SECONDS, limit: int = 1000) -> int:
    """Delete the rows of keys idle for ``idle`` seconds (at most ``limit``, oldest first)."""
    with connections[using].cursor() as cursor:
        cursor.execute(PRUNE_IDLE_KEYS_SQL, {"idle": idle, "limit": limit})
        return cursor.rowcount


@dataclass(frozen=True, slots=True)
class KeyState:
    """One concurrency key as the database has it now."""

    key: str
    limit: int | None
    running: int
    #: READY + RUNNING: the slots taken.
    admitted: int
    waiting: int
    waiting_capped: bool
    #: Slots kept for handlers still running after their rows stopped counting (timeouts, lapses).
    kept: int = 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.admitted + self.kept >= self.limit

    @property
    def waiting_label(self) -> str:
        return f"{self.waiting:,}+" if self.waiting_capped else f"{self.waiting:,}"


# Keep the slots of attempts the worker abandons at their timeout: only keyed rows it still holds
# (before the timeout is recorded, so the slot never counts as free in between).
KEEP_SLOTS_SQL = """
INSERT INTO tasks_concurrencyhold (key, task_id, token, worker, reason)
SELECT t.concurrency_key, t.id, t.token, t.holder, %(reason)s
FROM tasks_task AS t
JOIN unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token) ON t.id = d.id AND t.token = d.token
WHERE t.holder = %(worker)s AND t.status = 'RUNNING' AND t.concurrency_key IS NOT NULL
ON CONFLICT DO NOTHING
RETURNING task_id, token
"""

# The handlers of these attempts have returned: their slots are free (the delete's trigger admits).
RELEASE_KEPT_SQL = """
DELETE FROM tasks_concurrencyhold AS h
USING unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token)
WHERE h.task_id = d.id AND h.token = d.token AND h.worker = %(worker)s
"""

# Slots kept for handlers in processes known dead (stopped, or presumed dead by recovery) or never
# registered in this database. The table holds a handful of rows: stuck handlers only.
RELEASE_DEAD_SQL = """
DELETE FROM tasks_concurrencyhold AS h
WHERE NOT EXISTS (SELECT 1 FROM tasks_worker AS w WHERE w.id = h.worker AND w.stopped_at IS NULL)
RETURNING h.task_id
"""


def keep_slots(worker: str, attempts: list[tuple[int, int]], *, reason: str, using: str) -> set[tuple[int, int]]:
    """Keep the key slots of ``attempts`` (task id, token) that ``worker`` holds; returns those kept."""
    if not attempts:
        return set()
    params: dict[str, Any] = {
        "worker": worker,
        "reason": reason,
        "ids": [a[0] for a in attempts],
        "tokens": [a[1] for a in attempts],
    }
    with connections[using].cursor() as cursor:
        cursor.execute(KEEP_SLOTS_SQL, params)
        return {(task_id, token) for task_id, token in cursor.fetchall()}


def release_kept(worker: str, attempts: list[tuple[int, int]], *, using: str) -> int:
    """The handlers of ``attempts`` have returned: give back the slots kept for them (if any)."""
    if not attempts:
        return 0
    params: dict[str, Any] = {"worker": worker, "ids": [a[0] for a in attempts], "tokens": [a[1] for a in attempts]}
    with connections[using].cursor() as cursor:
        cursor.execute(RELEASE_KEPT_SQL, params)
        return cursor.rowcount


def release_dead(*, using: str = DEFAULT_DB_ALIAS) -> list[int]:
    """Give back the slots kept for handlers of workers known dead; returns their task ids."""
    with connections[using].cursor() as cursor:
        cursor.execute(RELEASE_DEAD_SQL)
        return [row[0] for row in cursor.fetchall()]


def admit(keys: list[str], *, using: str = DEFAULT_DB_ALIAS) -> dict[str, int]:
    """Fill the free slots of ``keys`` from their due waiting tasks now; tasks admitted per key (a key
    another transaction holds right now admits 0 and is noted for the next admission or the sweep)."""
    with connections[using].cursor() as cursor:
        cursor.execute(ADMIT_SQL, {"keys": sorted(set(keys))})
        return {key: n for key, n in cursor.fetchall()}


def admit_waiting(*, using: str = DEFAULT_DB_ALIAS, batch: int = SWEEP_BATCH, limit: int = SWEEP_KEYS) -> int:
    """The recovery round's sweep: admit for the keys whose admission was skipped (their row was held)
    and the keys whose first deferred task came due while a slot is free, read from an index: the
    cost is the keys there are to admit for, not the keys there are. One statement (one transaction)
    per ``batch`` of each kind, at most ``limit`` keys a round. Returns tasks admitted."""
    admitted = seen = 0
    with connections[using].cursor() as cursor:
        while seen < limit:
            cursor.execute(SWEEP_SQL, {"batch": batch})
            keys, n = cursor.fetchone()
            admitted += n
            seen += keys
            if keys < batch:
                break
    return admitted


def key_states(*, using: str | None = None, limit: int = SHOWN_KEYS, cap: int = WAITING_CAP) -> list[KeyState]:
    """Keys with admitted or waiting tasks (the first ``limit`` of each by name), fullest first, in
    ``using`` (default: the database the page or scrape selected)."""
    with connections[using or selected_database()].cursor() as cursor:
        cursor.execute(KEY_STATS_SQL, {"limit": limit, "cap": cap})
        rows: list[Any] = cursor.fetchall()
    states = [
        KeyState(key, lim, running, held, min(waiting, cap), waiting > cap, kept)
        for key, lim, running, held, waiting, kept in rows
    ]
    states.sort(key=lambda s: (not s.full, -s.waiting, s.key))
    return states
