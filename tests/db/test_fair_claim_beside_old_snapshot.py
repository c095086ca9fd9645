"""What a fair claim reads beside an old REPEATABLE READ snapshot (an analytics query, a
forgotten transaction, pg_dump), on the stack under test (PostgreSQL 15 in CI's second leg).

While the snapshot lives, no entry of a row claimed since it began can be removed from the claim
indexes. A plain claim resumes after its last positions and reads a few blocks per level whatever
was claimed (tests/db/test_claim_positions.py holds it to 20 blocks per level). A fair claim has no
positions: each key's turn scans the key from its front in tasks_task_fair_idx, and the fill scans
each level of tasks_task_claim_idx from its front, so both step over every entry claimed since the
snapshot, of the keys it visits (and, the fill, of the whole queue). Under a noisy tenant (the
case fair queues exist for) the claims concentrate on few keys, and each claim's cost grows with
the rows claimed since the snapshot began (invariant 12: costs do not grow with table size; a
claim reads indexes, never every finished row).


Found by breaker 33 (the bug hunt on fair queues, unique windows and debounce)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connection, transaction

from tasks.lifecycle import statements as sql
from tasks.lifecycle.values import ClaimedTask, ClaimPosition, FairPositions, claimed_from_row, fair_after_claim
from tasks.models import Task
from tests.helpers.task_paths import NOOP

QUEUE = "fair-snapshot33"
INDEXES = {"tasks_task_fair_idx", "tasks_task_claim_idx"}


@dataclass
class Memory:
    """A fair claimer's memory, as a worker keeps it (tasks/worker/dispatcher.py): its cursor, and
    where its claims stopped in each level (the fill's positions) and in each key."""

    after: str | None = None
    positions: dict[tuple[str, int], ClaimPosition] = field(default_factory=dict)
    keys: FairPositions = field(default_factory=lambda: FairPositions(400))

    def remember(self, claimed: list[ClaimedTask]) -> None:
        self.after = fair_after_claim(claimed, self.after)
        self.positions.update(ClaimPosition.last_per_level(claimed))
        self.keys.remember(claimed)


def params(memory: Memory, limit: int) -> dict[str, Any]:
    return {
        "worker": "snap",
        "ttl": 600.0,
        "limit": limit,
        "start": False,
        "isolate_after": 2,
        **sql.claim_params(
            [QUEUE],
            busy=False,
            isolate_after=2,
            after=list(memory.positions.values()),
            fair_after=memory.after,
            fair_positions=memory.keys,
        ),
    }


def claim_index_blocks(memory: Memory) -> tuple[dict[str, int], int]:
    """Blocks a fair claim of 10 reads in each claim index's scans (their heap visits included),
    the second of two runs under EXPLAIN (ANALYZE, BUFFERS), rolled back; and the rows it claimed."""
    for _ in range(2):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.FAIR_CLAIM_SQL, params(memory, 10))
            plan = cursor.fetchone()[0][0]["Plan"]
            transaction.set_rollback(True)

    def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    blocks = dict.fromkeys(sorted(INDEXES), 0)
    for node in nodes(plan):
        if node.get("Index Name") in INDEXES:
            blocks[node["Index Name"]] += int(node["Shared Hit Blocks"] + node["Shared Read Blocks"])
    return blocks, int(plan["Actual Rows"])


def drain(rows: int) -> Memory:
    """Claim ``rows`` in claims of 100 as a worker does (each after the last claim's cursor and
    positions: its claims come back full), committed."""
    memory, claimed = Memory(), 0
    with connection.cursor() as cursor:
        while claimed < rows:
            cursor.execute(sql.FAIR_CLAIM_SQL, params(memory, 100))
            got = [claimed_from_row(row) for row in cursor.fetchall()]
            assert len(got) == 100, claimed
            claimed += len(got)
            memory.remember(got)
    return memory


@pytest.mark.django_db(transaction=True)  # claims commit, as a worker's do, beside the other session's snapshot
def test_beside_an_old_snapshot_a_fair_claim_of_a_noisy_tenant_reads_few_blocks(old_snapshot: None) -> None:
    """Two tenants of 5,000 due tasks each (the plain test's 10,000 rows), one with a few deferred
    tasks of its own; 9,000 claimed beside the snapshot. A fair claim of 10 then must read about
    what it reads without the snapshot, as the plain resumed claim does."""
    Task.objects.bulk_enqueue(NOOP, [{}] * 5000, queue=QUEUE, fair_key="noisy")
    Task.objects.bulk_enqueue(NOOP, [{}] * 5000, queue=QUEUE, fair_key="quiet")
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue=QUEUE, fair_key="deferred", run_after=later)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    fresh, rows = claim_index_blocks(Memory())
    assert rows == 10
    memory = drain(9000)
    blocks, rows = claim_index_blocks(memory)
    assert rows == 10
    # a plain resumed claim: < 20 blocks per level; a fair one visits 3 keys and the fill's level
    bound = max(100, 3 * sum(fresh.values()))
    assert sum(blocks.values()) < bound, f"a fair claim of 10 read {blocks} (without the snapshot: {fresh})"
