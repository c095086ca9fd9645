"""Handing claimed attempts to the executors so that a SIGKILL is accounted for as it happened.

A short task's start marker rides on the statement that records its end (one row update per task,
not two), and a longer one's on the dispatcher's next round. A worker killed before that statement
commits left attempts that had run, side effects committed, looking as if they had never started:
recovery returned them uncharged as unstarted claims and they ran again uncharged (issue 38). So an
attempt whose start is lazy goes to an executor only once a committed round statement has named it
on the worker's own row (``tasks_worker.handed``: tasks/lifecycle/rounds.py, ``_HANDING_CTE``;
one row per round, whatever the batch), and recovery counts an attempt named there as one that may
have run: charged, recorded as the crash of an attempt (invariant 14). What the worker had not
handed over goes back uncharged (invariant 10). An attempt whose start is its own statement, sent
before its handler runs (a suspect's START_SQL, a rate-limited task's RATE_START_SQL), is never named
and goes to the executors at once.

The round that claims names the first of its claim at once (no round trip more before they start);
the rest wait here until the executors have room for them. An executor's room is its slot plus what
the executors start within ``AHEAD_ROUNDS`` round trips at the observed duration per task (never more
than the prefetch): enough that the executors do not wait on the next round, few enough that a kill
charges as begun little that had not begun. So a SIGKILL runs again at most the attempts the executors
had been handed: those running, and about ``AHEAD_ROUNDS`` round trips' worth of the executors' work
(docs/explanation/fault-model.md, "Attempt accounting").

Names are kept until the attempt's start or end is known to be on its row (its marker or its outcome
accepted); an outcome refused (the lease may have lapsed while the row still waits for recovery)
keeps its name for ``KEEP_REFUSED`` more seconds."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from leasing import clock
from tasks.lifecycle.ratelimits import queue_rates
from tasks.models import ClaimedTask
from tasks.runtime import Execution
from tasks.worker.ledger import Census, Ledger
from tasks.worker.sizing import ASYNC_SHARE_EPSILON, Capacity, smoothed

Key = tuple[int, int]

#: Round trips of the executors' work handed over ahead of their free slots.
AHEAD_ROUNDS = 2
#: Until the first round is timed: seconds per round statement.
FIRST_ROUND_TIME = 0.005
#: Smoothing of the measured round time.
ROUND_SMOOTHING = 0.2
#: Seconds a name stays on the worker's row after the attempt's outcome was refused.
KEEP_REFUSED = 120.0
#: Seconds between looks for names no longer needed (attempts handed back, refused ones' time up).
PRUNE_INTERVAL = 0.5


def lazy_start(task: ClaimedTask, rated_queues: Collection[str]) -> bool:
    """Its start marker rides on a later statement (not a suspect, no rate key, not of a rate-limited
    queue): it must be named before an executor may begin it."""
    return not task.suspect and task.rate_key is None and task.queue not in rated_queues


@dataclass(slots=True)
class Plan:
    """What one round hands over."""

    #: Attempts that waited here, handed to the executors once the round commits.
    releasing: list[Execution] = field(default_factory=list)
    #: Of the claim's rows whose start is lazy, how many the round names at once (in claim order).
    release: int = 0
    #: What the worker's row will name (None: the round writes no names).
    names: list[int] | None = None
    #: Room left per kind (True: the event loop) for the claim's named rows.
    left: dict[bool, int] = field(default_factory=dict)
    #: The worker's rate-limited queues as this round has them (the statement and the worker agree).
    rated_queues: frozenset[str] = frozenset()


class HandOff:
    def __init__(self, ledger: Ledger, *, queues: Sequence[str]) -> None:
        self.ledger = ledger
        self.queues = list(queues)
        self._waiting: list[Execution] = []  # claimed, start lazy, not handed over yet, in claim order
        # Handed over (named on the worker's row) and their start not known to be on their row:
        # attempt -> token; those whose outcome was refused: attempt -> (token, until when).
        self._named: dict[Key, int] = {}
        self._refused: dict[Key, tuple[int, float]] = {}
        self._pruned_at = 0.0
        self._rates: object = None
        self._rated: frozenset[str] = frozenset()
        self.round_time: float | None = None

    # -- sizing -------------------------------------------------------------------------------------

    def timed(self, seconds: float) -> None:
        """A round statement took ``seconds``."""
        self.round_time = smoothed(self.round_time, seconds, ROUND_SMOOTHING)

    def _ahead(self, slots: int, prefetch: int, duration: float | None) -> int:
        if duration is None or slots <= 0:
            return 0
        # Rounded down: tasks longer than the round trips go to free slots only, so that a kill
        # charges none of them that had not begun (each waits a round trip for its slot instead).
        rounds = AHEAD_ROUNDS * (self.round_time or FIRST_ROUND_TIME)
        return min(prefetch, math.floor(slots * rounds / max(duration, 1e-4)))

    def room(
        self, census: Census, capacity: Capacity, *, duration: float | None, async_duration: float | None
    ) -> dict[bool, int]:
        """Attempts each kind's executors may be handed now (True: the event loop)."""
        waiting_async = sum(e.is_async for e in self._waiting)
        waiting_sync = len(self._waiting) - waiting_async
        handed_async = census.async_unstarted + census.async_running - waiting_async
        handed_sync = census.in_hand - census.async_unstarted - census.async_running - waiting_sync
        return {
            False: capacity.slots + self._ahead(capacity.slots, capacity.prefetch, duration) - handed_sync,
            True: capacity.async_slots
            + self._ahead(capacity.async_slots, capacity.async_prefetch, async_duration)
            - handed_async,
        }

    def can_release(self, room: dict[bool, int]) -> bool:
        """Some waiting attempt has room now (a round should go to hand it over)."""
        return any(room[e.is_async] > 0 for e in self._waiting)

    # -- one round ----------------------------------------------------------------------------------

    def plan(self, room: dict[bool, int], *, claim: int, async_share: float, has_loop: bool) -> Plan:
        """What the next round hands over: waiting attempts while their kind has room, then as many of
        the claim as the kinds it is expected to bring have room left."""
        left = dict(room)
        plan = Plan(left=left, rated_queues=self._rated_queues())
        keep: list[Execution] = []
        for execution in self._waiting:
            if left[execution.is_async] > 0:
                left[execution.is_async] -= 1
                plan.releasing.append(execution)
            else:
                keep.append(execution)
        self._waiting = keep
        if claim:
            # The claim's kinds are known once its handlers are resolved: the share of coroutines
            # among recent claims says which kinds it brings (tasks/worker/sizing.py, room()).
            sync = not has_loop or async_share < 1.0 - ASYNC_SHARE_EPSILON
            coroutines = has_loop and async_share > ASYNC_SHARE_EPSILON
            plan.release = min(claim, max(0, left[False]) * sync + max(0, left[True]) * coroutines)
        if plan.releasing or plan.release:
            self._prune()
            plan.names = [*self._named.values(), *(token for token, _until in self._refused.values())]
            plan.names += [e.token for e in plan.releasing]
        return plan

    def _rated_queues(self) -> frozenset[str]:
        """The worker's rate-limited queues (their tasks take their start themselves), as the
        executors read them: the settings' parsed rates, looked at again when they change."""
        rates = queue_rates()
        if rates is not self._rates:
            self._rates, self._rated = rates, frozenset(q for q in self.queues if q in rates)
        return self._rated

    def _prune(self) -> None:
        """Forget the names no longer needed: an attempt handed back (no outcome to say so), a refused
        one's time up. At most every PRUNE_INTERVAL, reading the ledger under one lock."""
        now = clock.monotonic()
        if now - self._pruned_at < PRUNE_INTERVAL:
            return
        self._pruned_at = now
        held = self.ledger.keys()
        for key in [key for key in self._named if key not in held]:
            del self._named[key]
        for key in [key for key, (_token, until) in self._refused.items() if until <= now]:
            del self._refused[key]

    def not_sent(self, plan: Plan) -> None:
        """The round did not commit (or may not have): nothing of it was handed over."""
        self._waiting = plan.releasing + self._waiting

    def hand(self, plan: Plan, claimed: Sequence[ClaimedTask], executions: Iterable[Execution]) -> list[Execution]:
        """The round committed: what goes to the executors now (``executions``: the claim's attempts
        that the worker keeps, in claim order); the rest of the claim waits."""
        for execution in plan.releasing:
            self._named[execution.key] = execution.token
        rated = plan.rated_queues
        named = {task.id for task in [t for t in claimed if lazy_start(t, rated)][: plan.release]}
        now = list(plan.releasing)
        for execution in executions:
            if not lazy_start(execution.task, rated):
                now.append(execution)  # its own start statement comes before its handler
            elif execution.id in named:
                self._named[execution.key] = execution.token
                if plan.left.get(execution.is_async, 0) > 0:
                    plan.left[execution.is_async] -= 1
                    now.append(execution)
                else:
                    self._waiting.append(execution)  # named, handed over when its kind has room
            else:
                self._waiting.append(execution)
        return now

    # -- what became of the named attempts ----------------------------------------------------------

    def on_row(self, keys: Iterable[Key]) -> None:
        """Their start (a marker) or their end is on their row: the name is no longer needed."""
        for key in keys:
            self._named.pop(key, None)

    def refused(self, keys: Iterable[Key]) -> None:
        """Their outcome was refused: the row may still wait for recovery, which must see the name."""
        until = clock.monotonic() + KEEP_REFUSED
        for key in keys:
            token = self._named.pop(key, None)
            if token is not None:
                self._refused[key] = (token, until)

    def take_waiting(self) -> list[Execution]:
        """At a stop: the claims never handed over (they go back uncharged)."""
        waiting, self._waiting = self._waiting, []
        return waiting

    @property
    def waiting(self) -> int:
        return len(self._waiting)
