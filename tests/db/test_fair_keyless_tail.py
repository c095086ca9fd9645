"""The recovery leader's tail over new rows (tasks/maintenance/keyless.py,
ADOPT_NEW_KEYLESS_SQL) under a steady insert rate above its batch.

The tail reads at most ``batch`` rows by primary key per round, whatever their queue. The how-to
promises that the keyless rows an older replica inserts during a rolling deploy are adopted at the
next round. When the database takes more inserts per recovery round than the batch (KEYLESS_BATCH
is 1,000 per RECOVERY_INTERVAL of 2 s: 500 enqueues a second, over all queues of the database), the
tail fell further behind at every round and the keyless rows waited for the pass: the whole fair
backlog's length in rounds. Here at a tenth of the scale (batch 100). Now the tail reads batch after
batch up to the newest row (at most TAIL_BATCHES_PER_ROUND a round).

Found by breaker 33 (the bug hunt on fair queues, unique windows and debounce)."""

from __future__ import annotations

import pytest

from tasks.maintenance.keyless import KeylessAdopter
from tasks.models import Task
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fair_queues")]

BATCH = 100
ROUNDS = 10


def rounds_with(busy_per_round: int) -> list[list[bool]]:
    """A fair backlog of 20 batches (the pass needs 20 rounds to reach its end), then ROUNDS rounds,
    each after ``busy_per_round`` enqueues of a plain queue and one keyless row of the fair queue
    (as a replica on older code writes it). Per round, whether each keyless row so far is adopted."""
    Task.objects.bulk_enqueue(NOOP, [{}] * (20 * BATCH), queue="fair", fair_key="tenant")
    adopter = KeylessAdopter(batch=BATCH)
    adopter.run_once()  # the term's first round: the tail starts at the newest row
    keyless: list[int] = []
    seen = []
    for _ in range(ROUNDS):
        Task.objects.bulk_enqueue(NOOP, [{}] * busy_per_round, queue="busy33")
        [row] = Task.objects.bulk_enqueue(NOOP, [{}], queue="fair")
        Task.objects.filter(pk=row).update(fair_key=None)
        keyless.append(row)
        adopter.run_once()
        keys = dict(Task.objects.filter(pk__in=keyless).values_list("pk", "fair_key"))
        seen.append([keys[i] is not None for i in keyless])
    return seen


def test_keyless_rows_are_adopted_at_the_next_round_under_a_busy_plain_queue() -> None:
    """Twice the batch of inserts per round: each keyless row must be adopted by the round after
    the one it was inserted before (the documented promise), not rounds later."""
    seen = rounds_with(busy_per_round=2 * BATCH)
    late = [n for n, adopted in enumerate(seen[-1][:-1]) if not adopted]
    assert not late, f"after {ROUNDS} rounds, the keyless rows of rounds {late} still wait (per round: {seen})"


def test_below_the_batch_each_keyless_row_is_adopted_at_once() -> None:
    """The case shows what the test above measures: fewer inserts than the batch per round."""
    seen = rounds_with(busy_per_round=BATCH // 2)
    assert all(all(adopted) for adopted in seen), seen


def test_a_keyless_task_requeued_in_a_fair_queue_is_adopted_within_a_round_or_two() -> None:
    """A task of the queue from before it was fair (no key), finished, run again (requeue writes
    RERUN_SET: READY, now; it used to keep its NULL key). Its id is old, so the tail never reads it,
    and its start is the newest of its level, so the pass reaches it last: 20 rounds behind a fair
    backlog of 20 batches. It must take part in the turns as a new enqueue of the queue would (the
    shared key "") within a round or two: RERUN_SET now gives it that key itself."""
    [old] = Task.objects.bulk_enqueue(NOOP, [{}], queue="fair")
    Task.objects.filter(pk=old).update(fair_key=None, status="SUCCESSFUL")
    Task.objects.bulk_enqueue(NOOP, [{}] * (20 * BATCH), queue="fair", fair_key="tenant")
    adopter = KeylessAdopter(batch=BATCH)
    adopter.run_once()
    assert Task.objects.filter(pk=old).requeue() == 1
    for _ in range(2):
        adopter.run_once()
    assert Task.objects.get(pk=old).fair_key is not None, "the requeued task is still keyless: only a fill serves it"
