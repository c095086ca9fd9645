#!/usr/bin/env python
"""What one fair claim (tasks/lifecycle/statements.py, FAIR_CLAIM_SQL) reads beside a million rows:
EXPLAIN (ANALYZE, BUFFERS) of a claim of 10, rolled back, the second of two runs (warm, as in a
running system). Against DATABASE_URL (e.g. Debian's PostgreSQL 15, as .ci/run starts it).

    DATABASE_URL=postgres://... python bench/fair_claims.py [--deferred 200000] [--claimed 20000]
        [--deferred-keys 100000]

The table: 600,000 finished rows, 200,000 due rows over 1,000 keys of the fair queue, and key
``tenant-00000`` (the walk's first) with ``--deferred`` rows at priority 5 deferred an hour, in front
of its own due rows at priority 0. Cases:

- ``deferred``: a claim whose walk starts at that key (its turn steps over the deferred rows, or
  walks its priorities past them);
- ``fresh``: the same claim from a key with nothing deferred;
- ``deferred keys``: another fair queue of ``--deferred-keys`` keys whose one row each is deferred an
  hour (tenants with only snoozed or scheduled tasks), then 5 keys with due rows after them in key
  order: a claim from the first key (its walk passes over keys with nothing due, up to its bound,
  and the fill takes the rest), and one from just before the due keys;
- ``shares``: a tenant with a backlog of 4,000 (first in key order), ``--shares-deferred`` keys
  with nothing due (one row each, deferred an hour) and four tenants with 10 due rows each (last):
  claims of 16 (a worker's BATCH_SIZE), each committed, until the four are done; prints how many
  the backlog tenant started meanwhile (fair: about 10 each, 16 to 24 with the last claims' room);
- ``snapshot``: another session holds a REPEATABLE READ snapshot while ``--claimed`` rows are
  claimed and committed (their index entries cannot be removed), then the claim from the first key.
- ``noisy``: the fair queue rebuilt with a noisy tenant (``--noisy-rows`` due rows), 3 quiet ones
  (20,000 each) and one with only deferred rows (so the fill takes part in every claim); beside a
  snapshot, ``--noisy-claimed`` rows claimed by claims of 100 that resume as a worker's do (its
  positions in the levels and the keys, tasks/worker/dispatcher.py), then a claim of 10 that resumes
  and one from the front (no positions: every claim before breaker 33's fix).

Prints the statement's shared buffers (hit + read), the pick's, and the time.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django

django.setup()

from django.db import connection, connections, transaction  # noqa: E402

from tasks.lifecycle import statements as sql  # noqa: E402
from tasks.lifecycle.values import (  # noqa: E402
    ClaimedTask,
    ClaimPosition,
    FairPositions,
    claimed_from_row,
    fair_after_claim,
)

QUEUE = "fair-bench"
KEYS_QUEUE = "fair-bench-keys"
SHARES_QUEUE = "fair-bench-shares"
ROWS = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, fair_key)
SELECT %(queue)s, %(priority)s, 'bench.handlers.noop', '[]', '{}', %(status)s,
       now() + %(delay)s * interval '1 second' + g * interval '1 microsecond', now(),
       CASE WHEN %(status)s = 'SUCCESSFUL' THEN now() END, 0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false,
       %(prefix)s || lpad((g %% %(keys)s)::text, 5, '0')
FROM generate_series(1, %(n)s) AS g
"""


def build(deferred: int, deferred_keys: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM tasks_task WHERE queue IN (%s, %s, 'other')", [QUEUE, KEYS_QUEUE])
        layers: tuple[dict[str, Any], ...] = (
            {"queue": "other", "priority": 0, "status": "SUCCESSFUL", "delay": -120, "keys": 1, "n": 600_000},
            {"queue": QUEUE, "priority": 0, "status": "READY", "delay": -60, "keys": 1000, "n": 200_000},
            {"queue": QUEUE, "priority": 5, "status": "READY", "delay": 3600, "keys": 1, "n": deferred},
            # "deferred-…" sorts before "due-…": a walk from the first key meets the deferred keys first
            {
                "queue": KEYS_QUEUE,
                "priority": 0,
                "status": "READY",
                "delay": 3600,
                "keys": deferred_keys,
                "n": deferred_keys,
                "prefix": "deferred-",
            },
            {
                "queue": KEYS_QUEUE,
                "priority": 0,
                "status": "READY",
                "delay": -60,
                "keys": 5,
                "n": 1000,
                "prefix": "due-",
            },
        )
        for params in layers:
            cursor.execute(ROWS, {"prefix": "tenant-", **params})
        cursor.execute("VACUUM (ANALYZE) tasks_task")


def claim_params(after: str | None, queue: str = QUEUE) -> dict[str, Any]:
    params: dict[str, Any] = {
        "worker": "bench",
        "ttl": 30.0,
        "limit": 10,
        "start": False,
        "isolate_after": 2,
    }
    params.update(sql.claim_params([queue], busy=False, isolate_after=2, fair_after=after))
    return params


def explain(after: str | None, queue: str = QUEUE) -> tuple[int, int, float, int]:
    """(statement's blocks, the pick's, ms, rows) of a claim of 10 after ``after``, rolled back."""
    for _ in range(2):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.FAIR_CLAIM_SQL, claim_params(after, queue))
            top = cursor.fetchone()[0][0]
            transaction.set_rollback(True)
    plan = top["Plan"]
    picks = [node for node in plan["Plans"] if node.get("Parent Relationship") == "InitPlan"]
    pick = max(node["Shared Hit Blocks"] + node["Shared Read Blocks"] for node in picks)
    total = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    return total, pick, top["Execution Time"], plan["Actual Rows"]


def shares(deferred_keys: int) -> tuple[int, int]:
    """(tasks the backlog tenant started before the four small ones were done, claims it took)."""
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM tasks_task WHERE queue = %s", [SHARES_QUEUE])
        layers: tuple[dict[str, Any], ...] = (
            {"prefix": "a-backlog-", "delay": -60, "keys": 1, "n": 4000},
            {"prefix": "d-", "delay": 3600, "keys": max(deferred_keys, 1), "n": deferred_keys},
            {"prefix": "s-", "delay": -60, "keys": 4, "n": 40},
        )
        for params in layers:
            cursor.execute(ROWS, {"queue": SHARES_QUEUE, "priority": 0, "status": "READY", **params})
        cursor.execute("ANALYZE tasks_task")
        backlog, claims, small_left, after = 0, 0, 40, None
        while small_left:
            cursor.execute(sql.FAIR_CLAIM_SQL, {**claim_params(after, SHARES_QUEUE), "limit": 16})
            rows = cursor.fetchall()
            claims += 1
            after = next((row[24] for row in rows if row[24] is not None), after)  # FAIR_CURSOR
            backlog += sum(1 for row in rows if row[23].startswith("a-"))
            small_left -= sum(1 for row in rows if row[23].startswith("s-"))
        cursor.execute("DELETE FROM tasks_task WHERE queue = %s", [SHARES_QUEUE])
    return backlog, claims


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--noisy-rows", type=int, default=140_000)
    parser.add_argument("--noisy-claimed", type=int, default=50_000)
    parser.add_argument("--only-noisy", action="store_true", help="only the noisy tenant's case")
    parser.add_argument("--deferred", type=int, default=200_000)
    parser.add_argument("--claimed", type=int, default=20_000)
    parser.add_argument("--deferred-keys", type=int, default=100_000)
    parser.add_argument("--shares-deferred", type=lambda v: [int(n) for n in v.split(",")], default=[0, 100, 1000])
    args = parser.parse_args()
    if args.only_noisy:
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            print("PostgreSQL", cursor.fetchone()[0])
        noisy_case(args.noisy_rows, args.noisy_claimed)
        return
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        print("PostgreSQL", cursor.fetchone()[0])
    build(args.deferred, args.deferred_keys)
    cases: tuple[tuple[str, str | None, str], ...] = (
        ("deferred (walk starts at tenant-00000)", "tenant-00999", QUEUE),
        ("fresh", "tenant-00500", QUEUE),
        ("deferred keys: from the first", None, KEYS_QUEUE),
        ("deferred keys: from before the due ones", f"deferred-{args.deferred_keys - 4:05d}", KEYS_QUEUE),
    )
    for name, after, queue in cases:
        total, pick, ms, rows = explain(after, queue)
        print(f"{name:40} statement {total:7} blocks, pick {pick:7}, {ms:8.2f} ms, {rows:.0f} rows")
    for deferred_keys in args.shares_deferred:
        backlog, claims = shares(deferred_keys)
        print(f"shares beside {deferred_keys:6} keys with nothing due: the backlog tenant started {backlog:5}", end="")
        print(f" while the four started their 40 ({claims} claims of 16)")
    other = connections.create_connection("default")
    other.set_autocommit(False)
    try:
        with other.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("SELECT count(*) FROM leasing_lease")  # the snapshot is taken
        claimed, cursor_key = 0, None
        with connection.cursor() as cursor:
            while claimed < args.claimed:
                cursor.execute(sql.FAIR_CLAIM_SQL, {**claim_params(cursor_key), "limit": 100})
                claimed_rows = cursor.fetchall()
                claimed += len(claimed_rows)
                cursor_key = claimed_rows[0][24]  # FAIR_CURSOR
        snapshot_cases = (("snapshot: from the first key", None), ("snapshot: from tenant-00500", "tenant-00500"))
        for name, after in snapshot_cases:
            total, pick, ms, rows = explain(after)
            print(f"{name:40} statement {total:7} blocks, pick {pick:7}, {ms:8.2f} ms, {rows:.0f} rows")
    finally:
        other.rollback()
        other.close()
    noisy_case(args.noisy_rows, args.noisy_claimed)


class Memory:
    """A worker's memory of its fair claims: the cursor, its positions in the levels and the keys."""

    def __init__(self, after: str | None = None) -> None:
        self.after = after
        self.positions: dict[tuple[str, int], ClaimPosition] = {}
        self.keys = FairPositions(4 * 100)

    def remember(self, claimed: list[ClaimedTask]) -> None:
        self.after = fair_after_claim(claimed, self.after)
        self.positions.update(ClaimPosition.last_per_level(claimed))
        self.keys.remember(claimed)


def explained(params: dict[str, Any]) -> tuple[int, int, float, int]:
    """(statement's blocks, the pick's, ms, rows) of a fair claim with ``params``, rolled back."""
    for _ in range(2):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.FAIR_CLAIM_SQL, params)
            top = cursor.fetchone()[0][0]
            transaction.set_rollback(True)
    plan = top["Plan"]
    picks = [node for node in plan["Plans"] if node.get("Parent Relationship") == "InitPlan"]
    pick = max(node["Shared Hit Blocks"] + node["Shared Read Blocks"] for node in picks)
    total = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    return total, pick, top["Execution Time"], plan["Actual Rows"]


def resumed_params(memory: Memory, limit: int = 10) -> dict[str, Any]:
    """A fair claim's parameters as a worker sends them: its cursor and its positions."""
    return {
        **claim_params(memory.after),
        "limit": limit,
        **sql.claim_params(
            [QUEUE],
            busy=False,
            isolate_after=2,
            after=list(memory.positions.values()),
            fair_after=memory.after,
            fair_positions=memory.keys.values(),
        ),
    }


def build_noisy(noisy: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM tasks_task WHERE queue = %s", [QUEUE])
        layers: tuple[dict[str, Any], ...] = (
            {"prefix": "noisy-", "priority": 0, "status": "READY", "delay": -60, "keys": 1, "n": noisy},
            {"prefix": "quiet-", "priority": 0, "status": "READY", "delay": -60, "keys": 3, "n": 60_000},
            {"prefix": "later-", "priority": 0, "status": "READY", "delay": 3600, "keys": 1, "n": 100},
        )
        for params in layers:
            cursor.execute(ROWS, {"queue": QUEUE, **params})
        cursor.execute("VACUUM (ANALYZE) tasks_task")


def print_case(name: str, figures: tuple[int, int, float, int]) -> None:
    total, pick, ms, rows = figures
    print(f"{name:40} statement {total:7} blocks, pick {pick:7}, {ms:8.2f} ms, {rows:.0f} rows")


def noisy_case(noisy: int, claimed_rows: int) -> None:
    build_noisy(noisy)
    print_case("noisy: no snapshot, from the front", explain(None))
    other = connections.create_connection("default")
    other.set_autocommit(False)
    try:
        with other.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("SELECT count(*) FROM leasing_lease")  # the snapshot is taken
        memory, claimed = Memory(), 0
        with connection.cursor() as cursor:
            while claimed < claimed_rows:
                cursor.execute(sql.FAIR_CLAIM_SQL, resumed_params(memory, 100))
                got = [claimed_from_row(row) for row in cursor.fetchall()]
                if len(got) < 100:
                    raise RuntimeError(f"a resumed claim of 100 took {len(got)} after {claimed}")
                claimed += len(got)
                memory.remember(got)
        print_case(f"noisy: snapshot, {claimed} claimed, resumed", explained(resumed_params(memory)))
        print_case(f"noisy: snapshot, {claimed} claimed, front", explain(memory.after))
    finally:
        other.rollback()
        other.close()


if __name__ == "__main__":
    main()
