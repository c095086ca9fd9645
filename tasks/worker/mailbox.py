"""The hand-offs between a worker's threads, as named methods.

The dispatcher is the only thread that writes outcomes, start markers and hand-backs; every other
part (executor threads, the event loop, the heartbeat, the listener) puts what it has here and wakes
the dispatcher. Each queue is taken whole by the dispatcher once per round."""

from __future__ import annotations

import queue
import threading
from typing import Any, TypeVar

from leasing import clock
from tasks.runtime import Execution
from tasks.worker.ledger import Outcome

Key = tuple[int, int]
T = TypeVar("T")


def _take(source: queue.SimpleQueue[T]) -> list[T]:
    items: list[T] = []
    while True:
        try:
            items.append(source.get_nowait())
        except queue.Empty:
            return items


class Mailbox:
    def __init__(self) -> None:
        self._work: queue.SimpleQueue[Execution | None] = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._starts: queue.SimpleQueue[tuple[Execution, float]] = queue.SimpleQueue()
        self._returns: queue.SimpleQueue[Execution] = queue.SimpleQueue()  # claims an executor could not begin
        # Claims their rate key refused: already handed back by the refusing statement (RATE_START_SQL).
        # With when (local clock) each comes due again: the dispatcher looks for work then.
        self._refused: queue.SimpleQueue[tuple[Execution, float, Any]] = queue.SimpleQueue()
        # Started attempts to hand back with a reason (coroutines cancelled on lease loss, neighbours
        # of a coroutine that blocked the event loop): uncharged, the reason in their error entries.
        self._handbacks: queue.SimpleQueue[tuple[Execution, str]] = queue.SimpleQueue()
        # Lost or abandoned attempts whose handler returned: their kept key slots to give back.
        self._released: queue.SimpleQueue[Key] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._notified = threading.Event()  # a NOTIFY for one of the worker's queues arrived

    # -- to the executor threads ------------------------------------------------------------------

    def run(self, execution: Execution) -> None:
        """A claimed attempt for the next free executor thread."""
        self._work.put(execution)

    def next_work(self) -> Execution | None:
        """Blocks until there is an attempt to run; None: the thread ends."""
        return self._work.get()

    def end_executors(self, count: int) -> None:
        for _ in range(count):
            self._work.put(None)

    def take_unstarted(self) -> list[Execution]:
        """Attempts no executor has taken yet (at drain: handed back at once)."""
        return [e for e in _take(self._work) if e is not None]

    # -- to the dispatcher ------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def deliver(self, outcome: Outcome, *, wake: bool = True) -> None:
        """How an attempt ended, to be written by the next round."""
        self._outcomes.put(outcome)
        if wake:
            self._wake.set()

    def started(self, execution: Execution) -> None:
        """An attempt began (``begin_local``): its start marker goes with the next round, carrying the
        very epoch the attempt's TaskResult was built from. No wake-up: the dispatcher looks every
        MARKER_DELAY while it holds claims that may start or a marker it has not taken
        (``has_starts``). So an executor calls this *before* the ledger counts the attempt running:
        called after, a dispatcher reading the ledger in between saw neither and slept its whole
        poll interval with the marker unsent (a CI run waited 60 s on it)."""
        at = execution.started_epoch
        assert at is not None, "started() follows begin_local()"
        self._starts.put((execution, at))

    def give_back(self, execution: Execution) -> bool:
        """A claim an executor could not begin: handed back uncharged (or dropped if it lapsed).
        Returns False (the executor thread goes on)."""
        self._returns.put(execution)
        self._wake.set()
        return False

    def refused(self, execution: Execution, refusal: Any) -> bool:
        """A claim whose rate key refused its start: the statement that refused it handed it back
        (uncharged, to run at ``refusal.run_after``); the dispatcher only forgets it. Returns False."""
        self._refused.put((execution, clock.monotonic() + refusal.wait, refusal))
        self._wake.set()
        return False

    def hand_back_later(self, execution: Execution, reason: str) -> None:
        """A started attempt the dispatcher hands back (uncharged) with ``reason`` recorded."""
        self._handbacks.put((execution, reason))
        self._wake.set()

    def release_slot(self, key: Key) -> None:
        """The handler of a lost attempt has returned: its kept key slot goes back."""
        self._released.put(key)
        self._wake.set()

    def notify(self) -> None:
        """Work may have arrived (a NOTIFY, or the listener connected anew)."""
        self._notified.set()
        self._wake.set()

    # -- taken by the dispatcher ------------------------------------------------------------------

    def wait(self, seconds: float) -> bool:
        return self._wake.wait(seconds)

    def clear(self) -> bool:
        """Start of a round: forget the wake-up; True when a NOTIFY arrived since the last round."""
        self._wake.clear()
        if self._notified.is_set():
            self._notified.clear()
            return True
        return False

    def take_outcomes(self) -> list[Outcome]:
        return _take(self._outcomes)

    def take_starts(self) -> list[tuple[Execution, float]]:
        return _take(self._starts)

    def has_starts(self) -> bool:
        """A start marker is waiting that no round has taken yet."""
        return not self._starts.empty()

    def take_returns(self) -> list[Execution]:
        return _take(self._returns)

    def take_refused(self) -> list[tuple[Execution, float, Any]]:
        return _take(self._refused)

    def take_handbacks(self) -> list[tuple[Execution, str]]:
        return _take(self._handbacks)

    def take_released(self) -> list[Key]:
        return _take(self._released)
