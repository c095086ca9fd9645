"""The small frozen values the task statements return and take, and the checks of enqueue arguments."""

from __future__ import annotations

import datetime as dt
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from tasks.lifecycle.states import TaskStatus
from tasks.lifecycle.storable import MAX_MESSAGE, MAX_TRACEBACK, storable_text


@dataclass(frozen=True, slots=True)
class ClaimedTask:
    """One task handed to a worker: its id and the fencing token that proves the claim."""

    id: int
    token: int
    task_path: str
    args: list[Any]
    kwargs: dict[str, Any]
    attempts: int
    max_attempts: int
    progress: Any
    expires_at: dt.datetime
    timeout: float | None
    queue: str
    priority: int
    enqueued_at: dt.datetime
    worker_ids: list[str] = field(default_factory=list)
    #: An earlier attempt's worker vanished: this attempt is marked started before its handler runs.
    suspect: bool = False
    #: Its workers vanished ISOLATE_AFTER times beside other attempts: run it alone in the process.
    isolate: bool = False
    #: Enqueued through this django.tasks backend alias (None: ``Task.objects.enqueue``, any callable).
    backend_alias: str | None = None
    #: The django.tasks Task's own ``run_after`` as enqueued.
    task_run_after: dt.datetime | None = None
    #: Enqueued through the JSON API: the worker checks the path against the allow-list before importing it.
    api_origin: bool = False
    #: Its place in the claim order (with priority and id): where the worker's next claim resumes.
    run_after: dt.datetime | None = None
    #: The retry policy given at enqueue (dotted paths; tasks/lifecycle/policy.py), None for none.
    retry_policy: dict[str, Any] | None = None
    #: Its rate key (tasks/lifecycle/ratelimits.py): the attempt starts only once RATE_START_SQL grants it.
    rate_key: str | None = None
    #: The enqueuing span's context (what the propagator wrote: ``traceparent``, ``tracestate``), None
    #: when it was enqueued with tracing off (tasks/tracing.py).
    trace_context: dict[str, str] | None = None
    #: Its key in a fair queue (returned by a fair claim only).
    fair_key: str | None = None
    #: Where the claimer's next turn starts in a fair queue: the key that took its claim's last turn
    #: (the same on every row of a fair claim, None for other claims; FAIR_CURSOR).
    fair_cursor: str | None = None
    #: A fair claim's row its key's turn took (False: the claim's fill took it, or not a fair claim).
    fair_turn: bool = False

    @property
    def key(self) -> tuple[int, int]:
        """The attempt: task id + fencing token. Every in-memory structure is keyed by it."""
        return (self.id, self.token)


@dataclass(frozen=True, slots=True)
class Started:
    """A start marker that landed: the attempt number it charged and the task's start times."""

    id: int
    token: int
    attempt: int
    started_at: dt.datetime
    last_attempted_at: dt.datetime


@dataclass(frozen=True, slots=True)
class RateRefused:
    """A rate-limited start its key refused: the attempt went back uncharged, to run at ``run_after``."""

    id: int
    token: int
    run_after: dt.datetime
    #: Seconds from the refusal to ``run_after`` (the database's clock): when its worker looks again.
    wait: float = 0.0


@dataclass(frozen=True, slots=True)
class AttemptFate:
    """Where an attempt a worker was finishing ended, as the database says (for reconciliation)."""

    id: int
    token: int | None
    holder: str | None
    status: str
    last_error_token: str | None
    last_error_kind: str | None
    #: It snoozed after the current grant (a snooze leaves no error entry to tell by).
    snoozed: bool = False

    def completed_by(self, worker: str, token: int) -> bool:
        return self.status == TaskStatus.SUCCESSFUL and self.holder == worker and self.token == token

    def failed_by(self, worker: str, token: int, kind: str = "fail") -> bool:
        """The attempt's end of this kind (a :class:`Failure`'s ``kind``) landed."""
        if self.holder != worker:
            return False
        if kind == "snooze":  # (claimed again since: the snooze cannot be told apart, counted as refused)
            return self.token == token and self.status in (TaskStatus.BLOCKED, TaskStatus.READY) and self.snoozed
        if kind == "cancel":
            return (
                self.status == TaskStatus.CANCELLED
                and self.last_error_kind == "cancel"
                and (self.last_error_token == str(token))
            )
        return (
            self.status in (TaskStatus.BLOCKED, TaskStatus.READY, TaskStatus.FAILED)
            and self.last_error_kind == "failure"
            and self.last_error_token == str(token)
        )

    def still_held_by(self, worker: str, token: int) -> bool:
        return self.status == TaskStatus.RUNNING and self.holder == worker and self.token == token


@dataclass(frozen=True, slots=True)
class Enqueued:
    id: int
    #: False: an unfinished task with the same dedup key already existed, the key's unique_for window
    #: was open (``id`` is the task that opened it), or the enqueue was folded into the key's
    #: waiting debounced task (``id``)
    created: bool
    enqueued_at: dt.datetime | None = None  # of a task created now
    database: str = "default"  # the alias holding it: ids are unique per database only


@dataclass(frozen=True, slots=True)
class FailOutcome:
    id: int
    #: READY or BLOCKED (will be retried, or snoozed, until run_after; BLOCKED: a keyed task that
    #: gave its concurrency slot up while it waits) or FAILED / CANCELLED (terminal)
    status: str
    run_after: dt.datetime
    #: Seconds from the fail statement to ``run_after`` on the database clock: when a retried or
    #: snoozed task is due again (the delay its retry policy or the default backoff chose). None when
    #: not read from the statement (an outcome found by reconciliation after a lost reply).
    retry_in: float | None = None

    @property
    def retried(self) -> bool:
        """It waits to run again (retried or snoozed)."""
        return self.status not in (TaskStatus.FAILED, TaskStatus.CANCELLED)


@dataclass(frozen=True, slots=True)
class Recovered:
    id: int
    status: str
    expired_for: float | None  # seconds from lease expiry to requeue (None: it had no lease at all)
    kind: str = ""  # crash (charged), vanished (shared, not charged), returned (never started), orphan
    queue: str = ""
    attempt: int = 0  # the attempts the task had begun (the lost one among them, if it had started)
    worker: str | None = None  # the worker that held it

    @property
    def outcome(self) -> str:
        """How the lost attempt ended, for its log record: ``failed`` (FAILED for good, out of crashes),
        else its kind (``crash``, ``vanished``, ``returned``, ``orphan``): requeued."""
        return "failed" if self.status == "FAILED" else self.kind or "requeued"

    @property
    def crashed(self) -> bool:
        """The attempt had started when its lease expired (charged or not)."""
        return self.kind in ("crash", "vanished")


@dataclass(frozen=True, slots=True)
class Failure:
    """What a worker reports for a failed attempt."""

    id: int
    token: int
    exception_class_path: str
    message: str
    traceback: str = ""
    retry: bool = True
    #: How the attempt ended: "fail" (charged; retried per ``retry``), "snooze" (run again after
    #: ``delay`` seconds, uncharged) or "cancel" (CANCELLED, ``message`` the reason). See FAIL_SQL.
    kind: str = "fail"
    #: Seconds: the snooze, or the policy's backoff for a retried failure (None: the default backoff).
    delay: float | None = None
    #: The retry policy's limit when it is not the row's own (None: the row's ``max_attempts``).
    max_attempts: int | None = None
    #: When the worker called the handler (epoch seconds), for an attempt whose start marker rides on
    #: this report (None: the attempt's start is recorded already, or unknown: the report's own clock).
    started: float | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.id, self.token)

    def as_json(self) -> str:
        # Error text is made storable (NUL, lone surrogates escaped; long tracebacks cut in the
        # middle) so that one attempt's odd exception can never make the statement fail.
        return json.dumps(
            {
                "exception_class_path": storable_text(self.exception_class_path, 255),
                "message": storable_text(self.message, MAX_MESSAGE),
                "traceback": storable_text(self.traceback, MAX_TRACEBACK),
            }
        )


#: JSON texts most rows hold (no arguments, no workers yet): built without the parser, each a new object.
_EMPTY_JSON: dict[str, Any] = {"[]": list, "{}": dict}


def json_value(value: Any) -> Any:
    # Django registers a text loader for jsonb, so raw cursors see JSON as strings.
    if value.__class__ is str:
        empty = _EMPTY_JSON.get(value)
        return empty() if empty is not None else json.loads(value)
    return value


# A frozen dataclass's __init__ sets each of its fields through object.__setattr__: 3.4 us for a
# ClaimedTask's 21, against 0.8 us for plain stores, and a worker builds one per claimed row on the
# dispatcher's thread (the one thread every task goes through). The fields' slot descriptors set
# them directly (1.8 us), and the value stays frozen to everyone else.
_CLAIMED_SLOTS = tuple(getattr(ClaimedTask, name).__set__ for name in ClaimedTask.__dataclass_fields__)
_new = object.__new__


def claimed_from_row(row: Sequence[Any]) -> ClaimedTask:
    """A claim statement's row (CLAIM_RETURNING's columns, in its order) as a ClaimedTask."""
    task = _new(ClaimedTask)
    for set_slot, value in zip(
        _CLAIMED_SLOTS,
        (
            row[0],
            row[1],
            row[2],
            json_value(row[3]),
            json_value(row[4]),
            row[5],
            row[6],
            json_value(row[7]),
            row[8],
            row[9],
            row[10],
            row[11],
            row[12],
            json_value(row[13]),
            bool(row[14]),
            bool(row[15]),
            row[16],
            row[17],
            bool(row[18]),
            row[19],
            json_value(row[20]) if len(row) > 20 else None,
            row[21] if len(row) > 21 else None,
            json_value(row[22]) if len(row) > 22 else None,  # NULL (None) unless enqueued traced
            row[23] if len(row) > 23 else None,  # a fair claim's rows only (FAIR_CLAIM_RETURNING)
            row[24] if len(row) > 24 else None,
            bool(row[25]) if len(row) > 25 else False,
        ),
        strict=True,
    ):
        set_slot(task, value)
    return task


@dataclass(frozen=True, slots=True)
class ClaimPosition:
    """A place in a queue's claim order (priority high to low, then run_after, then id): a claim
    given one starts after it in that queue and level (docs/explanation/claims.md, "Resuming
    where the last claims stopped")."""

    queue: str
    priority: int
    run_after: dt.datetime
    id: int

    @classmethod
    def last_per_level(cls, claimed: Sequence[ClaimedTask]) -> dict[tuple[str, int], ClaimPosition]:
        """The furthest position among ``claimed`` in each queue and priority level they came from
        in the claim order: a fair claim's rows its keys' turns took are no such place (the rows
        before them in the level are other keys', not claimed), only those its fill took."""
        last: dict[tuple[str, int], ClaimPosition] = {}
        for task in claimed:
            if task.run_after is None or task.fair_turn:
                continue
            here = cls(task.queue, task.priority, task.run_after, task.id)
            seen = last.get((task.queue, task.priority))
            if seen is None or (seen.run_after, seen.id) < (here.run_after, here.id):
                last[task.queue, task.priority] = here
        return last


@dataclass(frozen=True, slots=True)
class FairPosition:
    """A place in one fair key's claim order (priority high to low, then run_after, then id): the
    key's turn in a fair claim given one starts after it in that priority level of the key
    (tasks/lifecycle/claim.py, ``mine``)."""

    fair_key: str
    priority: int
    run_after: dt.datetime
    id: int

    @classmethod
    def last_per_key_level(cls, claimed: Sequence[ClaimedTask]) -> dict[tuple[str, int], FairPosition]:
        """The furthest position among ``claimed`` in each fair key and priority level they came from
        (rows of a fair claim only: the others have no key), whether the key's turn or the fill took
        them (either way the key's rows before it in the level are claimed)."""
        last: dict[tuple[str, int], FairPosition] = {}
        for task in claimed:
            if task.run_after is None or task.fair_key is None:
                continue
            here = cls(task.fair_key, task.priority, task.run_after, task.id)
            seen = last.get((task.fair_key, task.priority))
            if seen is None or (seen.run_after, seen.id) < (here.run_after, here.id):
                last[task.fair_key, task.priority] = here
        return last


class FairPositions:
    """A fair claimer's positions in the keys it took rows from lately, one per key and priority
    level, the most recent ``bound`` keys only (a claim sends them all: its cost stays bounded by
    the batch size, never by the number of keys). A key left out is scanned from its front by its
    next turn, as before positions: correct, only slower beside an old snapshot.

    They help only a worker that comes back to the keys it claimed from before they are pushed out:
    one that goes round at most ``bound`` keys with due tasks (a noisy tenant and a few others, the
    case beside an old snapshot that made claims grow). Going round more, it comes back to none of
    them: ``revisits`` (its last claim took rows from a key it remembered, or had before the last
    :meth:`clear`) tells the worker whether to send them at all; sent for nothing, they cost a claim
    of 64 over 6,000 keys 1.4 ms more (PostgreSQL 15, its prepared generic plan).

    The claim takes them as one JSON object, each key's positions under its name (``mine`` in
    tasks/lifecycle/claim.py); each key's member is written when it is sent after its
    positions changed (all 256 of a worker of BATCH_SIZE 64, written anew for each claim, took
    465 us of the dispatcher's thread; the bookkeeping of a claim of 64 now takes 70 us over 20
    keys, 180 us over 64 when sent)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.revisits = False
        self._keys: OrderedDict[str, dict[int, tuple[dt.datetime, int]]] = OrderedDict()  # (run_after, id)
        self._members: dict[str, str] = {}
        self._dirty: set[str] = set()  # keys whose member is not written yet
        self._cleared: set[str] = set()  # the keys :meth:`clear` dropped, for ``revisits``

    def clear(self) -> None:
        """Drop every position (a claim from the front replaces them)."""
        self._cleared = set(self._keys)
        self._keys.clear()
        self._members.clear()
        self._dirty.clear()

    def remember(self, claimed: Sequence[ClaimedTask]) -> None:
        """Where ``claimed`` stopped in each key and level it came from, the most recent last (no
        FairPosition built: a frozen dataclass's __init__ costs microseconds on the dispatcher's thread)."""
        furthest: dict[str, dict[int, tuple[dt.datetime, int]]] = {}
        for task in claimed:
            if task.run_after is None or task.fair_key is None:
                continue
            here = (task.run_after, task.id)
            levels = furthest.setdefault(task.fair_key, {})
            seen = levels.get(task.priority)
            if seen is None or seen < here:
                levels[task.priority] = here
        kept = self._keys
        self.revisits = any(key in kept or key in self._cleared for key in furthest)
        self._cleared = set()
        for key, moved in furthest.items():
            levels = kept.pop(key, {})
            levels.update(moved)
            kept[key] = levels
            self._dirty.add(key)
        while len(kept) > self.bound:
            key, _levels = kept.popitem(last=False)
            self._members.pop(key, None)
            self._dirty.discard(key)

    def values(self) -> list[FairPosition]:
        return [
            FairPosition(key, priority, run_after, id)
            for key, levels in self._keys.items()
            for priority, (run_after, id) in levels.items()
        ]

    def json(self) -> str:
        for key in self._dirty:
            self._members[key] = _member(key, self._keys[key])
        self._dirty.clear()
        return "{" + ",".join(self._members.values()) + "}"


def _member(key: str, levels: dict[int, tuple[dt.datetime, int]]) -> str:
    """One key's member of a fair claim's ``after_key_positions``: its positions under its name."""
    return (
        encode_basestring_ascii(key)  # json.dumps's own quoting, without its per-call set-up
        + ":["
        + ",".join(
            f'{{"priority":{priority},"run_after":"{run_after.isoformat()}","id":{id}}}'
            for priority, (run_after, id) in levels.items()
        )
        + "]"
    )


def fair_positions_json(positions: FairPositions | Sequence[FairPosition]) -> str:
    """A fair claim's ``after_key_positions``: each key's positions under its name (``mine``)."""
    if isinstance(positions, FairPositions):
        return positions.json()
    keys: dict[str, dict[int, tuple[dt.datetime, int]]] = {}
    for p in positions:
        keys.setdefault(p.fair_key, {})[p.priority] = (p.run_after, p.id)
    return "{" + ",".join(_member(key, levels) for key, levels in keys.items()) + "}"


def validate_queue(queue: Any) -> None:
    """A queue name: a non-empty string of at most 100 characters that text can hold (no NUL, no lone
    surrogate). Every enqueue checks it before anything is written (Task.objects.enqueue and
    bulk_enqueue, a workflow's steps, the django.tasks backend), as do pause and resume."""
    if not isinstance(queue, str) or not queue or len(queue) > 100:
        raise ValueError("queue must be a non-empty name of at most 100 characters")
    if "\x00" in queue:
        raise ValueError("queue must not contain NUL characters")
    try:
        queue.encode()
    except UnicodeEncodeError:
        raise ValueError("queue must be valid Unicode (no lone surrogates)") from None


def validate_enqueue(*, queue: str, priority: int, max_attempts: int, timeout: float | None) -> None:
    validate_queue(queue)
    if not -100 <= priority <= 100:
        raise ValueError("priority must be between -100 and 100")
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    if timeout is not None and not timeout > 0:
        raise ValueError("timeout must be positive")


#: The largest concurrency limit (the column is a PostgreSQL integer).
MAX_CONCURRENCY_LIMIT = 2**31 - 1


def validate_key(name: str, key: Any) -> None:
    """A key column's value: a non-empty string of at most 255 characters that text can hold."""
    if not isinstance(key, str) or not key or len(key) > 255:
        raise ValueError(f"{name} must be a non-empty string of at most 255 characters")
    if "\x00" in key:
        raise ValueError(f"{name} must not contain NUL characters")
    try:
        key.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be valid Unicode (no lone surrogates)") from None


def validate_concurrency(key: str | None, limit: int | None) -> None:
    """A concurrency key comes with a limit of at least 1, and a limit with a key."""
    if key is None and limit is None:
        return
    if key is None or limit is None:
        raise ValueError("concurrency_key and concurrency_limit go together: give both or neither")
    if not isinstance(key, str) or not key or len(key) > 255:
        raise ValueError("concurrency_key must be a non-empty string of at most 255 characters")
    if "\x00" in key:
        raise ValueError("concurrency_key must not contain NUL characters")
    try:
        key.encode()
    except UnicodeEncodeError:
        raise ValueError("concurrency_key must be valid Unicode (no lone surrogates)") from None
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CONCURRENCY_LIMIT:
        raise ValueError(f"concurrency_limit must be a whole number from 1 to {MAX_CONCURRENCY_LIMIT}")


def fair_key_for(queue: str, key: str | None, fair_queues: Sequence[str]) -> str | None:
    """The fair key to store for a task of ``queue``: the given one (checked), else the shared key
    "" in a fair queue (so that the queue's every task takes part in the turns), else None."""
    if key is None:
        return "" if queue in fair_queues else None
    if not isinstance(key, str) or len(key) > 255:
        raise ValueError("fair_key must be a string of at most 255 characters")
    if "\x00" in key:
        raise ValueError("fair_key must not contain NUL characters")
    try:
        key.encode()
    except UnicodeEncodeError:
        raise ValueError("fair_key must be valid Unicode (no lone surrogates)") from None
    return key


def fair_after_claim(claimed: Sequence[ClaimedTask], before: str | None) -> str | None:
    """Where the next fair claim's turns start: the key that took this claim's last turn, as the
    claim statement returns it (FAIR_CURSOR: where its walk went, not which keys the rows came
    from); ``before`` when the claim took nothing or found no keys."""
    for task in claimed:
        if task.fair_cursor is not None:
            return task.fair_cursor
    return before


#: The longest event name (its wait's steps are named ``wait:<name>`` and ``event:<name>``).
MAX_EVENT_NAME = 150

#: Event names beginning with this are a child task's outcome (``task:<child id>``), stored only by
#: the child's end (migration 0041's trigger): no send may store one, no wait_for_event read one.
CHILD_EVENT = "task:"


def event_name(name: Any) -> str:
    """``name`` if an event may be sent or waited for under it (tasks.steps, tasks.workflows)."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_EVENT_NAME or "\x00" in name:
        raise ValueError(f"an event's name is a non-empty string of at most {MAX_EVENT_NAME} characters: {name!r}")
    if name.startswith(CHILD_EVENT):
        raise ValueError(
            f"event names beginning with {CHILD_EVENT!r} are a child task's outcome, stored by its end only"
            f" (spawn() and wait_for_task()): {name!r}"
        )
    return name
