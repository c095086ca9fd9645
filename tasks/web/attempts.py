"""A task's attempts, each once and in order, built from the row's two histories.

The row keeps ``worker_ids`` (one entry per attempt that started, in order: a snooze takes its own
back, a "Retry" / "Run again" keeps them) and ``errors`` (one entry per attempt that ended other than
by returning, plus events that were no attempt, capped: the first entry and the newest nine,
``errors_dropped`` counting those dropped between). An entry's ``attempt`` number is **not** an
attempt's identity, and keying the page by it is what lost attempts and showed two "Attempt 1"s:

- a rerun ("Retry", "Run again": tasks/lifecycle/transitions.py ``RERUN_SET``) sets ``attempts`` back
  to 0, so the second run's first failure is numbered 1 again;
- a claim whose lease expired before its attempt started is recorded (``kind`` ``returned``, and an
  ``orphan`` repair) with the number of the attempt *before* it (nothing was charged), as are
  ``dependency`` and ``discard`` entries (no attempt at all).

So the attempts are ``worker_ids``, numbered 1, 2, 3 … across reruns. An entry that ends an attempt
(``failure``, ``cancel``, ``crash``, ``vanished``, ``shutdown``) carries the attempt's ``position``, its
1-based place in ``worker_ids`` (entries written since issue 41), and is matched to it exactly. Older
entries without one are matched by order, newest first (the newest entries are never dropped) and by
worker; the first entry (always kept) from the oldest attempt. An attempt left without an entry
returned (it succeeded before a "Run again", or is the last of a successful task), is running now, or
had its entry dropped ("Not known" when it lies between kept entries and some were dropped). The other
entries are events, listed apart.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from django.utils.dateparse import parse_datetime

from tasks.lifecycle import vocabulary

#: Entry kinds that end an attempt that started (and so has its worker in ``worker_ids``).
ENDS_AN_ATTEMPT = frozenset({"failure", "cancel", "crash", "vanished", "shutdown"})

#: Outcome of an attempt by the kind of entry that ended it (the vocabulary's labels where a status is
#: meant; the rest say what happened to the attempt, not the task).
OUTCOMES = {
    "failure": "Failed",
    "cancel": vocabulary.label("CANCELLED"),
    "crash": "Lost its worker (charged)",
    "vanished": "Lost its worker (not charged)",
    "shutdown": "Handed back at shutdown",
}


@dataclass
class Attempt:
    number: int
    worker: str
    outcome: str
    started_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None
    error: dict[str, Any] | None = None

    @property
    def duration(self) -> float | None:
        if self.started_at is None or self.ended_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds()


@dataclass
class History:
    attempts: list[Attempt] = field(default_factory=list)
    #: Entries that ended no attempt (returned uncharged, orphan repairs, dependency, discard), oldest first.
    events: list[dict[str, Any]] = field(default_factory=list)


def entry_time(entry: dict[str, Any] | None) -> dt.datetime | None:
    value = (entry or {}).get("at")
    if isinstance(value, dt.datetime):
        return value
    return parse_datetime(value) if isinstance(value, str) else None


def ends_an_attempt(entry: dict[str, Any]) -> bool:
    kind = entry.get("kind")
    # Entries written before ``kind`` existed were the handler's failures.
    return kind in ENDS_AN_ATTEMPT if kind is not None else bool(entry.get("attempt"))


def history(task: Any) -> History:
    """Every attempt of ``task`` once, numbered in order, with its outcome, times and error."""
    workers = [str(w) for w in (task.worker_ids or [])]
    errors = [e for e in (task.errors or []) if isinstance(e, dict)]
    endings = [i for i, e in enumerate(errors) if ends_an_attempt(e)]
    matched: dict[int, int] = {}  # attempt index -> entry index
    for entry_index in endings:
        place, owner = errors[entry_index].get("position"), str(errors[entry_index].get("worker"))
        if isinstance(place, int) and 0 < place <= len(workers) and workers[place - 1] == owner:
            matched.setdefault(place - 1, entry_index)
    legacy = [i for i in endings if i not in matched.values()]
    # Entries without a trusted position (written before issue 41, or naming another worker's
    # attempt) are matched by order and worker, newest first, each between the attempts of the
    # positioned entries around it (entries are in the order they were written). The last attempt
    # of a task running one, or that returned, has no entry.
    by_entry = {entry_index: index for index, entry_index in matched.items()}
    # A RUNNING task whose claim has not started (a batch waiting in its worker's queue) runs no
    # attempt yet: its last one in ``worker_ids`` ended before.
    running = task.status == "RUNNING" and bool(task.attempt_started)
    last_open = bool(workers) and (running or task.status == "SUCCESSFUL")
    position = len(workers) - 1 - int(last_open)
    first_kept = endings[0] if task.errors_dropped and endings and endings[0] == 0 else None
    for entry_index in reversed([i for i in legacy if i != first_kept]):
        worker = errors[entry_index].get("worker")
        position = min([position] + [index - 1 for e, index in by_entry.items() if e > entry_index])
        floor = max([index + 1 for e, index in by_entry.items() if e < entry_index], default=0)
        # Walk back to the attempt of this entry's worker; attempts passed on the way had no entry.
        candidate = position
        while candidate >= floor and (candidate in matched or (worker is not None and workers[candidate] != worker)):
            candidate -= 1
        if candidate < floor:
            continue  # no attempt of its worker where it can lie: listed with the events
        matched[candidate] = entry_index
        position = candidate - 1
    if first_kept is not None and first_kept in legacy:
        worker = errors[first_kept].get("worker")
        for index in range(min(position + 1, len(workers))):
            if index not in matched and (worker is None or workers[index] == worker):
                matched[index] = first_kept
                break
    earliest_match = min(matched, default=len(workers))
    latest_match = max(matched, default=-1)
    used = set(matched.values())
    result = History(events=[e for i, e in enumerate(errors) if i not in used])
    previous_end: dt.datetime | None = None
    for index, worker in enumerate(workers):
        entry = errors[matched[index]] if index in matched else None
        attempt = Attempt(number=index + 1, worker=worker, outcome="", error=entry)
        if entry is not None:
            attempt.outcome = OUTCOMES.get(str(entry.get("kind")), "Failed")
            attempt.ended_at = entry_time(entry)
            attempt.started_at = _started(entry)
        elif index == len(workers) - 1 and last_open:
            attempt.outcome = vocabulary.label(task.status)
            attempt.ended_at = task.finished_at if task.status == "SUCCESSFUL" else None
        elif task.errors_dropped and first_kept is not None and earliest_match < index < latest_match:
            attempt.outcome = "Not known (its error entry was dropped)"
        else:
            attempt.outcome = vocabulary.label("SUCCESSFUL")  # returned, then was run again
        if index == len(workers) - 1 and attempt.started_at is None:
            attempt.started_at = task.last_attempted_at
        if index == 0 and attempt.started_at is None:
            attempt.started_at = task.started_at
        if attempt.started_at is not None and previous_end is not None and attempt.started_at < previous_end:
            attempt.started_at = None  # a stale column (a rerun keeps started_at): unknown rather than wrong
        previous_end = attempt.ended_at or previous_end
        result.attempts.append(attempt)
    return result


def _started(entry: dict[str, Any]) -> dt.datetime | None:
    value = entry.get("started_at")
    return parse_datetime(value) if isinstance(value, str) else None
