"""How much a worker claims: pure functions of what it holds (a :class:`~tasks.worker.ledger.Census`)
and what it has seen (:class:`Pace`), unit-tested without threads or a database.

A worker holds no more claims than its executors will start within the prefetch window: a claim it
holds but cannot start is a task another worker could be running."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tasks.worker.ledger import Census

#: Smoothing of the observed task duration that sizes the prefetch.
DURATION_SMOOTHING = 0.2
#: Smoothing of the share of async attempts among claims (sizes a claim by the mix of kinds).
ASYNC_SHARE_SMOOTHING = 0.3
#: Below this share (or above 1 minus it) a claim is sized for one kind alone (the other kind's free
#: slots are then probed for once per poll interval).
ASYNC_SHARE_EPSILON = 0.05
#: Tasks such a probe claims at most (what is not of the kind with free slots goes back at once).
PROBE_SIZE = 8


#: Claims a worker of the default settings takes at most per executor thread, and in all at least.
BATCH_PER_THREAD = 4
MIN_BATCH_SIZE = 16


def default_batch_size(concurrency: int) -> int:
    """The claim's size when none is set: four per executor thread (or event-loop slot, for the loop's
    kind: :func:`claim_cap`), at least 16.

    A worker's rounds are serial (each one statement and one commit), so under a steady offered load a
    worker finishes at most one batch per round: with 16 threads of 1 ms tasks and a batch of 16, one
    process kept up with 2,500 tasks/s offered and no more; with 64, with 4,000/s (a probe,
    docs/explanation/benchmarks.md, "Sustained load against the peers"). What a worker holds stays bounded by what its
    threads start within ``PREFETCH_WINDOW`` (:func:`prefetch`), whatever the batch: a larger one is
    taken only while there is a backlog to take."""
    return max(MIN_BATCH_SIZE, BATCH_PER_THREAD * concurrency)


def claim_cap(batch_size: int, async_batch_size: int, share: float) -> int:
    """The most one claim takes: the batch of the threads and the batch of the event loop, weighed by
    the share of coroutines among recent claims (a claim cannot choose by kind). With a batch set
    (``BATCH_SIZE``, ``--batch-size``) both are that batch; by default each is four a slot of its
    kind, so a loop of 16 coroutines running 1 ms jobs claims 64, not the threads' 16 (which held
    it under 4,000 jobs/s offered: docs/explanation/benchmarks.md, "Sustained load against the peers")."""
    return max(1, round(batch_size + (async_batch_size - batch_size) * share))


def smoothed(previous: float | None, sample: float, weight: float) -> float:
    """An exponential moving average (the first sample stands alone)."""
    return sample if previous is None else previous + weight * (sample - previous)


def prefetch(slots: int, *, batch_size: int, window: float, duration: float | None, backlog: bool = False) -> int:
    """Claims to hold beyond ``slots`` executors: what they will start within ``window`` seconds at
    the observed ``duration`` per task (none until a task has run), at most one batch; two while
    the worker drains a ``backlog`` (its last claim came back full): the next claim is then in
    flight while the last one's tasks run, rather than after them, so that short tasks do not leave
    the executors waiting on the statement (a one-process drain of no-op tasks +8 %,
    docs/explanation/benchmarks.md). After a short claim, one batch: then what is there goes to
    every worker's free slots rather than into one worker's hand."""
    if duration is None or slots <= 0:
        return 0
    return min(batch_size * (2 if backlog else 1), math.floor(slots * window / max(duration, 1e-4)))


@dataclass(slots=True)
class Pace:
    """What the worker has observed: seconds per task of each kind, the share of coroutines among
    recent claims, and when it may next probe for the kind recent claims did not bring."""

    duration: float | None = None
    async_duration: float | None = None
    async_share: float = 0.0
    next_probe: float = 0.0

    def observe(self, elapsed: float) -> None:
        self.duration = smoothed(self.duration, elapsed, DURATION_SMOOTHING)

    def observe_async(self, elapsed: float) -> None:
        self.async_duration = smoothed(self.async_duration, elapsed, DURATION_SMOOTHING)

    def observe_claim(self, kinds: Sequence[bool]) -> None:
        """A claim brought these kinds (True: a coroutine)."""
        if kinds:
            self.async_share = smoothed(self.async_share, sum(kinds) / len(kinds), ASYNC_SHARE_SMOOTHING)


@dataclass(frozen=True, slots=True)
class Capacity:
    """The worker's slots and their prefetch, this round: threads, and event-loop slots (0: no loop)."""

    slots: int
    prefetch: int
    async_slots: int = 0
    async_prefetch: int = 0


@dataclass(frozen=True, slots=True)
class Room:
    claim: int
    #: The claim looks for the kind recent claims did not bring (the next probe waits a poll interval).
    probe: bool = False


def room(census: Census, capacity: Capacity, *, share: float, probe_due: bool) -> Room:
    """How many to claim: enough to fill the free slots (plus prefetch) of either kind at the observed
    mix of kinds; what does not fit is handed back at once (:func:`fit`). With no event loop, or only
    sync tasks seen, this is exactly the threads' room."""
    sync_in_hand = census.in_hand - census.async_unstarted - census.async_running
    sync_room = max(0, capacity.slots + capacity.prefetch - sync_in_hand)
    if capacity.async_slots <= 0:
        return Room(sync_room)
    async_room = max(0, capacity.async_slots + capacity.async_prefetch - census.async_unstarted - census.async_running)
    wanted = 0.0
    if share < 1.0 - ASYNC_SHARE_EPSILON:
        wanted = max(wanted, sync_room / (1.0 - share))
    if share > ASYNC_SHARE_EPSILON:
        wanted = max(wanted, async_room / share)
    if wanted < 1:
        # One kind's slots are free but recent claims brought only the other kind: look again once
        # in a while (the queue's mix may have changed), never every round.
        unseen = async_room if share <= ASYNC_SHARE_EPSILON else sync_room
        if unseen and probe_due:
            return Room(min(unseen, PROBE_SIZE), probe=True)
    return Room(math.floor(wanted))


def starving(census: Census, capacity: Capacity, *, share: float) -> bool:
    """Refill before the executors run dry: fewer claims ready than idle executors, or (short tasks,
    prefetch allowed) than executors."""
    idle = capacity.slots - (census.running - census.async_running)
    if census.unstarted - census.async_unstarted < max(idle, min(capacity.slots, capacity.prefetch)):
        return True
    if capacity.async_slots > 0 and share > ASYNC_SHARE_EPSILON:
        idle_async = capacity.async_slots - census.async_running
        return census.async_unstarted < max(idle_async, min(capacity.async_slots, capacity.async_prefetch))
    return False


def fit(kinds: Sequence[bool], census: Census, capacity: Capacity) -> list[bool]:
    """Which attempts of a claim (by kind, True: a coroutine) the executors will start within the
    prefetch window; the rest is handed back at once (uncharged): a claim cannot choose by kind, and a
    worker must not hold tasks it cannot start while another worker could. The claim was sized by
    the observed mix, so there is excess only while that mix changes."""
    async_held = census.async_unstarted + census.async_running
    free = {
        False: capacity.slots + capacity.prefetch - (census.in_hand - async_held),
        True: capacity.async_slots + capacity.async_prefetch - async_held,
    }
    kept = []
    for kind in kinds:
        keep = free[kind] > 0
        if keep:
            free[kind] -= 1
        kept.append(keep)
    return kept
