"""Breaker 32's keyless rows: a fair queue's READY rows without a key (enqueued before the queue was
fair, or by a replica on older code) are reached only by the claim's fill, which a busy fair queue
never runs. The recovery leader gives them the shared key "" a bounded batch at a time
(tasks/maintenance/keyless.py), and they take their turn."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from django.db import connection, transaction

from tasks.lifecycle.values import fair_after_claim
from tasks.maintenance.keyless import ADOPT_KEYLESS_SQL, KeylessAdopter
from tasks.maintenance.recovery import RecoveryController
from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fair_queues")]


def keyless(queue: str, n: int, priority: int = 0) -> list[int]:
    """Rows of ``queue`` as an older replica enqueues them: no fair key."""
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * n, queue=queue, priority=priority)
    Task.objects.filter(pk__in=ids).update(fair_key=None)
    return ids


def serve(claims: int, limit: int) -> Counter[str]:
    after: str | None = None
    served: Counter[str] = Counter()
    for _ in range(claims):
        claimed = Task.objects.claim("w", limit=limit, queues=["fair"], fair_after=after)
        after = fair_after_claim(claimed, after)
        served += Counter("(none)" if c.fair_key is None else c.fair_key or '""' for c in claimed)
    return served


def test_a_keyless_row_waits_behind_busy_keys_until_the_leader_gives_it_the_shared_key() -> None:
    old = keyless("fair", 3)  # the oldest rows of the queue
    for tenant in ("a", "b"):
        Task.objects.bulk_enqueue(NOOP, [{}] * 50, queue="fair", fair_key=tenant)
    assert serve(5, limit=2) == {"a": 5, "b": 5}  # the fill never runs: the keyless rows wait
    rounds = KeylessAdopter(batch=1000).run_once()
    assert [(r.queue, r.read, r.adopted, r.finished_pass) for r in rounds] == [("fair", 93, 3, True)]
    assert set(Task.objects.filter(pk__in=old).values_list("fair_key", flat=True)) == {""}
    assert serve(3, limit=3)['""'] == 3  # a key of their own: one turn each claim


def test_a_pass_reads_a_batch_a_round_in_claim_order_and_leaves_keyed_and_plain_rows_alone() -> None:
    high = keyless("fair", 7, priority=5)
    keyed = Task.objects.bulk_enqueue(NOOP, [{}] * 10, queue="fair", fair_key="t")
    low = keyless("fair", 8, priority=-3)
    plain = keyless("plain", 5)
    adopter = KeylessAdopter(batch=10)
    reads = []
    while True:
        [round_] = adopter.run_once()
        reads.append((round_.read, round_.adopted))
        if round_.finished_pass:
            break
    # 25 READY rows of the queue, 10 a round: high's 7 and 3 keyed, the other 7 keyed and 3 of low, the rest
    assert reads == [(10, 7), (10, 3), (5, 5)]
    assert adopter.positions == {}  # the next pass starts at the front
    keys = dict(Task.objects.values_list("pk", "fair_key"))
    assert {keys[i] for i in high + low} == {""}
    assert {keys[i] for i in keyed} == {"t"}
    assert {keys[i] for i in plain} == {None}


def test_rows_a_replica_on_older_code_inserts_now_are_adopted_at_the_next_round_not_a_pass_later() -> None:
    """During a rolling deploy the keyless rows are the newest: at the end of their level, where the
    pass reaches them last (here 100 rounds on). The tail (the rows inserted since the last round,
    by primary key) adopts them at the next round."""
    Task.objects.bulk_enqueue(NOOP, [{}] * 1000, queue="fair", fair_key="t")
    adopter = KeylessAdopter(batch=10)
    adopter.run_once()  # the pass reads the front; the tail starts at the newest row
    new = keyless("fair", 4)
    plain = keyless("plain", 2)
    [round_] = adopter.run_once()
    assert round_.adopted == 0  # the pass is still among the first keyed rows
    keys = dict(Task.objects.filter(pk__in=new + plain).values_list("pk", "fair_key"))
    assert [keys[i] for i in new] == [""] * 4
    assert [keys[i] for i in plain] == [None, None]


@pytest.mark.django_db(transaction=True)
def test_a_row_another_session_holds_is_passed_over_not_waited_for() -> None:
    from django.db import connections

    ids = keyless("fair", 2)
    other = connections.create_connection("default")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [ids[0]])
        [round_] = KeylessAdopter().run_once()  # does not block
        assert (round_.read, round_.adopted) == (2, 1)
        other.rollback()
    finally:
        other.close()
    assert dict(Task.objects.values_list("pk", "fair_key")) == {ids[0]: None, ids[1]: ""}


def test_a_rounds_reads_do_not_grow_with_the_backlog() -> None:
    """A round reads one batch of the claim index and its rows, wherever the pass stands: beside
    50,000 READY rows as beside 2,000."""

    def blocks(queue: str, position: tuple[int, Any, int]) -> int:
        params = {"queue": queue, "priority": position[0], "run_after": position[1], "id": position[2], "batch": 500}
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + ADOPT_KEYLESS_SQL, params)
            plan = cursor.fetchone()[0][0]["Plan"]
            transaction.set_rollback(True)
        return plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]

    from tests.db.test_fair_claims import FAIR_ROWS_SQL

    with connection.cursor() as cursor:
        for queue, n in (("small", 2_000), ("large", 50_000)):
            cursor.execute(FAIR_ROWS_SQL, {"queue": queue, "path": NOOP, "status": "READY", "keys": 10, "n": n})
        cursor.execute("ANALYZE tasks_task")
    results = {}
    for queue in ("small", "large"):
        row = Task.objects.filter(queue=queue).order_by("run_after", "id")[1000]
        results[queue] = [blocks(queue, (32767, row.run_after, 0)), blocks(queue, (0, row.run_after, row.id))]
    assert max(results["large"]) < 1.3 * max(results["small"]) + 10, results


@pytest.mark.django_db(transaction=True)
def test_the_recovery_leader_adopts_them() -> None:
    ids = keyless("fair", 4)
    controller = RecoveryController(interval=0.1, prune=False, history=False)
    thread = threading.Thread(target=controller.run)
    thread.start()
    try:
        wait_until(
            lambda: not Task.objects.filter(pk__in=ids, fair_key__isnull=True).exists(), 30, what="the rows adopted"
        )
    finally:
        controller.stop()
        thread.join(30)
