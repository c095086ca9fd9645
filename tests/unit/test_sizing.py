"""How much a worker claims, as pure functions of its census (tasks/worker/sizing.py): no thread, no
database. The real-process tests show the same rules hold in a running worker."""

from __future__ import annotations

import pytest

from tasks.worker.ledger import Census
from tasks.worker.sizing import (
    ASYNC_SHARE_EPSILON,
    PROBE_SIZE,
    Capacity,
    Pace,
    claim_cap,
    default_batch_size,
    fit,
    prefetch,
    room,
    smoothed,
    starving,
)


def test_no_prefetch_before_a_task_has_run_then_what_starts_within_the_window_at_most_a_batch() -> None:
    assert prefetch(4, batch_size=100, window=0.5, duration=None) == 0
    assert prefetch(4, batch_size=100, window=0.5, duration=0.1) == 20
    assert prefetch(4, batch_size=10, window=0.5, duration=0.001) == 10
    assert prefetch(4, batch_size=100, window=0.5, duration=0.0) == 100  # instant tasks: one batch, no division by 0
    assert prefetch(0, batch_size=100, window=0.5, duration=0.1) == 0  # no event loop, no async prefetch


def test_a_backlog_doubles_the_prefetch_of_short_tasks_only() -> None:
    # Draining a backlog: the next batch is claimed while the last one runs.
    assert prefetch(8, batch_size=64, window=0.25, duration=0.0001, backlog=True) == 128
    assert prefetch(8, batch_size=64, window=0.25, duration=0.0001) == 64
    # The window still bounds it: tasks of 50 ms, 8 executors start 40 within 0.25 s.
    assert prefetch(8, batch_size=64, window=0.25, duration=0.05, backlog=True) == 40
    assert prefetch(8, batch_size=64, window=0.25, duration=None, backlog=True) == 0


def test_threads_only_room_is_the_free_slots_plus_prefetch() -> None:
    capacity = Capacity(slots=4, prefetch=2)
    assert room(Census(), capacity, share=0.0, probe_due=True).claim == 6
    assert room(Census(in_hand=5, running=4, unstarted=1), capacity, share=0.0, probe_due=True).claim == 1
    assert room(Census(in_hand=9), capacity, share=0.0, probe_due=True).claim == 0


def test_a_mixed_claim_is_sized_by_the_observed_share_of_coroutines() -> None:
    capacity = Capacity(slots=4, prefetch=0, async_slots=2, async_prefetch=0)
    # Half the recent claims were coroutines: filling 4 free threads at that mix takes a claim of 8
    # (the coroutines beyond the loop's 2 slots are handed back by fit()).
    assert room(Census(), capacity, share=0.5, probe_due=False).claim == 8
    # Nearly all coroutines: enough to fill the loop's 2 slots at that mix.
    wide = Capacity(slots=4, prefetch=0, async_slots=100, async_prefetch=0)
    assert room(Census(), wide, share=0.99, probe_due=False).claim == 101


def test_the_kind_not_seen_lately_is_probed_for_only_when_a_probe_is_due() -> None:
    capacity = Capacity(slots=4, prefetch=0, async_slots=10, async_prefetch=0)
    full_threads = Census(in_hand=4, running=4)  # only sync seen (share 0), threads all busy
    assert room(full_threads, capacity, share=0.0, probe_due=False).claim == 0
    probe = room(full_threads, capacity, share=0.0, probe_due=True)
    assert probe.probe and probe.claim == min(10, PROBE_SIZE)


def test_starving_when_fewer_claims_wait_than_idle_executors() -> None:
    capacity = Capacity(slots=4, prefetch=0)
    assert starving(Census(), capacity, share=0.0)
    assert not starving(Census(in_hand=4, running=0, unstarted=4), capacity, share=0.0)
    mixed = Capacity(slots=4, prefetch=0, async_slots=8, async_prefetch=0)
    full_threads = Census(in_hand=8, running=0, unstarted=8, async_unstarted=4)
    assert starving(full_threads, mixed, share=ASYNC_SHARE_EPSILON * 2)  # the loop waits on 4 of 8
    assert not starving(full_threads, mixed, share=0.0)  # coroutines not expected: only threads count


def test_fit_keeps_what_each_kind_can_start_and_hands_back_the_rest_in_order() -> None:
    capacity = Capacity(slots=2, prefetch=0, async_slots=1, async_prefetch=0)
    kinds = [False, True, False, True, False]
    assert fit(kinds, Census(), capacity) == [True, True, True, False, False]
    held = Census(in_hand=2, running=2)  # the threads are busy already
    assert fit([False, True], held, capacity) == [False, True]


@pytest.mark.parametrize(("previous", "sample", "expected"), [(None, 3.0, 3.0), (1.0, 3.0, 1.4), (2.0, 2.0, 2.0)])
def test_smoothing(previous: float | None, sample: float, expected: float) -> None:
    assert smoothed(previous, sample, 0.2) == pytest.approx(expected)


def test_pace_learns_durations_and_the_mix_of_claims() -> None:
    pace = Pace()
    pace.observe(1.0)
    pace.observe(2.0)
    pace.observe_async(0.5)
    pace.observe_claim([True, True, False, False])
    pace.observe_claim([])  # an empty claim says nothing of the mix
    assert (pace.duration, pace.async_duration) == (pytest.approx(1.2), 0.5)
    assert pace.async_share == pytest.approx(0.15)


def test_the_default_claim_is_four_tasks_a_thread_and_at_least_sixteen() -> None:
    assert default_batch_size(1) == 16
    assert default_batch_size(4) == 16  # the default concurrency: the batch it always had
    assert default_batch_size(16) == 64
    assert default_batch_size(50) == 200


def test_a_claim_takes_the_batch_of_the_kind_recent_claims_brought() -> None:
    threads, loop = default_batch_size(4), default_batch_size(16)  # 16 and 64
    assert claim_cap(threads, loop, share=0.0) == 16  # sync tasks only: the threads' batch
    assert claim_cap(threads, loop, share=1.0) == 64  # coroutines only: four a slot of the loop
    assert claim_cap(threads, loop, share=0.5) == 40
    assert claim_cap(32, 32, share=0.7) == 32  # a batch set: the same for both kinds
