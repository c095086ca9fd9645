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

from tasks.models import Failure
from tasks.runtime import Execution


@dataclass(slots=True)
class Outcome:
    """How an attempt ended, waiting to be written: a result as JSON text, or a failure."""

    execution: Execution
    value_json: str | None = None
    failure: Failure | None = None
    extra: dict[str, Any] = field(default_factory=dict)

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
    unstarted: int = 0
    running: int = 0
    overdue: list[Execution] = field(default_factory=list)
    next_deadline: float | None = None  # earliest timeout among running attempts (local clock)


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int], Execution] = {}

    def add(self, executions: Iterable[Execution]) -> None:
        with self._lock:
            for execution in executions:
                self._entries[execution.key] = execution

    def remove(self, keys: Iterable[tuple[int, int]]) -> None:
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def snapshot(self) -> list[Execution]:
        with self._lock:
            return list(self._entries.values())

    def census(self, now: float) -> Census:
        census = Census()
        with self._lock:
            for e in self._entries.values():
                if e.finished or e.abandoned:
                    continue
                census.in_hand += 1
                if e.started is None:
                    census.unstarted += 1
                    continue
                census.running += 1
                if e.task.timeout is not None:
                    deadline = e.started + e.task.timeout
                    if deadline <= now:
                        census.overdue.append(e)
                    elif census.next_deadline is None or deadline < census.next_deadline:
                        census.next_deadline = deadline
        return census

    def to_heartbeat(self) -> list[Execution]:
        """Attempts whose lease this worker still keeps alive (finished ones too, until written)."""
        return [e for e in self.snapshot() if not e.abandoned and not e.lost and not e.heartbeat_paused]

    def in_hand(self) -> list[Execution]:
        """Claimed or running, not yet finished: what counts against the worker's capacity."""
        return [e for e in self.snapshot() if not e.finished and not e.abandoned]

    def running(self) -> list[Execution]:
        return [e for e in self.snapshot() if e.running and not e.finished and not e.abandoned]
