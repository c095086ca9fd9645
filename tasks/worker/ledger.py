"""The worker's one record of the attempts it holds, keyed by attempt (task id + fencing token).

Every part of the worker (claimer, executors, heartbeat, outcome writer) reads and changes this
ledger, never a map keyed by task id: an old attempt of a task (timed out, its thread still busy)
and the next attempt of the same task in the same process are two entries that cannot evict each
other (invariant 11).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from leasing import clock
from tasks.models import Failure
from tasks.runtime import Execution


@dataclass(slots=True)
class Outcome:
    """How an attempt ended, waiting to be written: a result as JSON text, or a failure."""

    execution: Execution
    value_json: str | None = None
    failure: Failure | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: The exception that failed the attempt (for django.tasks' ``task_finished`` receivers).
    error: BaseException | None = None

    @property
    def key(self) -> tuple[int, int]:
        return self.execution.key

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass(slots=True)
class Census:
    """The ledger counted in one pass (the dispatcher reads it once per round)."""

    in_hand: int = 0  # claimed or running, not finished: counts against capacity
    isolated: int = 0  # attempts in hand that must run alone
    unstarted: int = 0
    running: int = 0
    async_unstarted: int = 0  # of ``unstarted``: coroutines for the event loop
    async_running: int = 0  # of ``running``: coroutines on the event loop
    overdue: list[Execution] = field(default_factory=list)
    next_deadline: float | None = None  # earliest timeout among running attempts (local clock)


class Ledger:
    """Attempts by key, with their states counted as they change (the dispatcher reads the counts on
    every round, so they must not cost a pass over every attempt)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int], Execution] = {}
        self._unstarted = 0
        self._running = 0
        self._async_unstarted = 0
        self._async_running = 0
        self._timed: dict[tuple[int, int], Execution] = {}  # running attempts that have a timeout
        self._isolated = 0

    def add(self, executions: Iterable[Execution]) -> None:
        with self._lock:
            for execution in executions:
                self._entries[execution.key] = execution
                self._unstarted += 1
                self._async_unstarted += execution.is_async
                self._isolated += execution.task.isolate

    def begin(self, execution: Execution) -> None:
        """The executor is about to call the handler (``execution.begin*`` already ran)."""
        with self._lock:
            if execution.key in self._entries:
                self._unstarted -= 1
                self._running += 1
                self._async_unstarted -= execution.is_async
                self._async_running += execution.is_async
                if execution.task.timeout is not None:
                    self._timed[execution.key] = execution

    def _leave_executor(self, execution: Execution) -> bool:
        if execution.finished or execution.abandoned:
            return False
        if execution.key in self._entries:
            self._running -= 1
            self._async_running -= execution.is_async
            self._timed.pop(execution.key, None)
        return True

    def finish(self, execution: Execution) -> bool:
        """The handler returned. False when the attempt had been abandoned: drop its result."""
        with self._lock:
            if not self._leave_executor(execution):
                return False
            execution.finished = True
            execution.finished_at = clock.monotonic()
            return True

    def abandon(self, execution: Execution) -> bool:
        """Past its timeout: the attempt stops counting as running. False if it had just finished."""
        with self._lock:
            if not self._leave_executor(execution):
                return False
            execution.abandoned = True
            return True

    def remove(self, keys: Iterable[tuple[int, int]]) -> None:
        with self._lock:
            for key in keys:
                execution = self._entries.pop(key, None)
                if execution is None:
                    continue
                self._isolated -= execution.task.isolate
                if execution.finished or execution.abandoned:
                    continue
                if execution.started is None:
                    self._unstarted -= 1
                    self._async_unstarted -= execution.is_async
                else:
                    self._running -= 1
                    self._async_running -= execution.is_async
                    self._timed.pop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> set[tuple[int, int]]:
        """The attempts held, read under one lock."""
        with self._lock:
            return set(self._entries)

    def snapshot(self) -> list[Execution]:
        with self._lock:
            return list(self._entries.values())

    def census(self, now: float) -> Census:
        with self._lock:
            census = Census(
                in_hand=self._unstarted + self._running,
                unstarted=self._unstarted,
                running=self._running,
                isolated=self._isolated,
                async_unstarted=self._async_unstarted,
                async_running=self._async_running,
            )
            for execution in self._timed.values():
                deadline = (execution.started or now) + (execution.task.timeout or 0.0)
                if deadline <= now:
                    census.overdue.append(execution)
                elif census.next_deadline is None or deadline < census.next_deadline:
                    census.next_deadline = deadline
        return census

    def to_heartbeat(self, now: float, ttl: float) -> list[Execution]:
        """Attempts whose lease this worker still keeps alive: finished ones too, until written, but
        not for more than a TTL (a write stuck that long must not keep a task RUNNING forever), unless
        the write waits for a lock another session holds: the database is there and the outcome is
        ours to write once that session commits (an operator's requeue of a workflow member inside
        a transaction holds its workflow's settle until then). Given up, the lease would lapse and
        recovery would charge a completed attempt as a crash and run it again."""
        return [
            e
            for e in self.snapshot()
            if not e.abandoned
            and not e.lost
            and not e.heartbeat_paused
            and not (e.finished and not e.write_waits and now - e.finished_at > ttl)
        ]
