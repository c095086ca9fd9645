"""Typed settings of the task queue, read from ``settings.LEASING_TASKS`` (Django's own ``TASKS``
setting configures ``django.tasks`` backends, so ours has its own name)."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from django.conf import settings
from django.core.signals import setting_changed

T = TypeVar("T")

#: What is kept, and how long, unless ``LEASING_TASKS["RETENTION"]`` says otherwise.
DEFAULT_RETENTION: dict[str, Any] = {
    "SUCCESSFUL": "7d",
    "CANCELLED": "7d",
    "FAILED": "30d",
    "LEASES": "1d",
    "WORKERS": "7d",
    "SCHEDULE_RUNS": "7d",
    # Windows of unique keys (unique_for) that passed: nothing needs them once they have.
    "UNIQUE_KEYS": "0s",
    # Bulk operations (retry / cancel / discard on a filter) that ended: their record and counts.
    "BULK_OPERATIONS": "30d",
}


#: ARCHIVE_AFTER's default: the mover is on (None turns it off).
DEFAULT_ARCHIVE_AFTER = "10m"
#: ARCHIVE_BUSY_FRACTION's default, and what the mover works while the setting is invalid.
DEFAULT_ARCHIVE_BUSY_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class TaskSettings:
    #: Lease of a claimed task, seconds. A dead worker's tasks run again within TTL + RECOVERY_INTERVAL.
    TTL: float = 30.0
    #: Failed attempts (the handler's own: an exception, a timeout, an unstorable result) before a
    #: task ends FAILED for good. Each attempt's error is kept.
    MAX_ATTEMPTS: int = 3
    #: Attributable crashes before a task ends FAILED: started attempts whose lease expired while
    #: their worker lived on (the attempt stalled), or that ran isolated when their worker died (a
    #: poison pill). Attempts that merely ran beside a worker's death are charged nothing.
    MAX_CRASHES: int = 5
    #: A task whose worker vanished this many times while it ran beside other attempts (shared
    #: crashes, charged to no one) runs isolated from then on: alone in its worker process, so that
    #: its next crash is attributable and counts against MAX_CRASHES.
    ISOLATE_AFTER: int = 2
    #: Retry delay: BACKOFF_BASE * 2**(attempt-1) seconds, capped at BACKOFF_MAX, jittered 50-100 %.
    BACKOFF_BASE: float = 1.0
    BACKOFF_MAX: float = 300.0
    #: Retry policies per queue: queue name -> {"max_attempts", "retry_on" (exception paths),
    #: "backoff" (the path of a function (attempt, exception) -> seconds)}; see tasks/lifecycle/policy.py.
    RETRY_POLICIES: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Rate limits per queue: queue name -> "14/s", "100/min", "5/10s" or (count, seconds). Every task
    #: of the queue without a rate key of its own shares the queue-wide key ``queue:<name>``: at most
    #: that many starts in any sliding window on the database clock (tasks/lifecycle/ratelimits.py).
    RATE_LIMITS: dict[str, Any] = field(default_factory=dict)
    #: Fair queues: claims from one of these take turns between its tasks' keys (``fair_key``, a
    #: tenant) instead of draining the oldest key first; a task enqueued into one without a key gets
    #: the shared key "" (docs/howto/pausing-and-keys.md, "Fair queues").
    FAIR_QUEUES: tuple[str, ...] = ()
    #: Worker defaults (command-line options override them).
    CONCURRENCY: int = 4
    #: Tasks one claim takes at most; None: four per executor thread, at least 16, and four per
    #: event-loop slot for coroutines (tasks/worker/sizing.py, ``default_batch_size``, ``claim_cap``).
    BATCH_SIZE: int | None = None
    POLL_INTERVAL: float = 2.0
    #: Coroutines (``async def`` handlers) one worker process runs at once on its event loop; 0 runs
    #: them on the executor threads instead (one thread each, through async_to_sync).
    ASYNC_CONCURRENCY: int = 100
    #: Threads (each with its own database connection) that serve the event loop's database work:
    #: checkpoints, start markers and ``sync_to_async(thread_sensitive=False)`` calls of handlers.
    ASYNC_DB_THREADS: int = 4
    #: Seconds the event loop may go without turning before the coroutine blocking it is abandoned
    #: (recorded as EventLoopBlocked), its neighbours handed back and a fresh loop started.
    ASYNC_BLOCK_LIMIT: float = 10.0
    #: A worker holds, beyond its running tasks, only as many claimed tasks as its executors will
    #: start within this many seconds (from the observed task durations), at most BATCH_SIZE.
    PREFETCH_WINDOW: float = 0.25
    SHUTDOWN_GRACE: float = 10.0
    #: How often the (leader-elected) recovery controller runs, seconds.
    RECOVERY_INTERVAL: float = 2.0
    #: Task paths the JSON API may enqueue: exact names (API_TASKS) or regular expressions matched
    #: against the whole path with ``re.fullmatch`` (API_TASK_PATTERNS). Python workers import and run
    #: a task's path, so an API client must not be able to name any callable it likes: whatever the
    #: lists say, only a public function (or django.tasks Task) defined at module level in the named
    #: module is accepted, and a worker checks again before it runs a task that came through the API.
    #: Empty by default: a project lists what its API clients may enqueue (the demo lists its handler).
    API_TASKS: tuple[str, ...] = ()
    API_TASK_PATTERNS: tuple[str, ...] = ()
    #: Failure injection of the demo handler (fractions of tasks). Off unless configured.
    DEMO_CRASH_RATE: float = 0.0
    DEMO_STALL_RATE: float = 0.0
    #: Retention (tasks/maintenance/retention.py): how long finished tasks (per final status), ended leases,
    #: stopped or dead workers and schedule runs are kept. Durations as seconds, a timedelta or
    #: "7d" / "12h" / "30m"; None keeps forever. Given keys override these defaults; RETENTION =
    #: None turns the automatic pruning by the recovery leader off (``prune_tasks`` still works).
    RETENTION: dict[str, Any] | None = field(default_factory=lambda: dict(DEFAULT_RETENTION))
    #: Seconds between automatic pruning passes of the recovery leader.
    RETENTION_INTERVAL: float = 60.0
    #: Rows deleted per statement (each its own short transaction).
    RETENTION_BATCH_SIZE: int = 1000
    #: Share of the time the automatic pruner may spend deleting: it rests between batches so that
    #: pruning a large backlog never takes more than this fraction of a database connection's time.
    RETENTION_BUSY_FRACTION: float = 0.25
    #: Bulk operations (tasks/maintenance/bulk.py), worked by the recovery leader between rounds: tasks
    #: changed per statement at most, task ids one statement may read at most, and the share of the
    #: recovery interval the leader may spend on them.
    BULK_BATCH_SIZE: int = 1000
    BULK_SPAN: int = 20_000
    BULK_BUSY_FRACTION: float = 0.5
    #: Hours of history (tasks/maintenance/history.py) the recovery leader keeps in its hourly rollup,
    #: and the most the history page and ``/api/history`` show: 168 is 7 days.
    HISTORY_HOURS: int = 168
    #: Days ahead of today (UTC) for which the recovery leader keeps the day partitions of
    #: ``tasks_finished`` created, per final status (tasks/maintenance/partitions.py): the margin
    #: before a leader that cannot create them (no leader, a lock it never gets) leaves a day without
    #: its partition. ``tasks_finished_days_ahead`` and the alert TasksFinishedPartitionsBehind watch it.
    FINISHED_DAYS_AHEAD: int = 3
    #: Finished plain tasks older than this (a duration) are moved by the recovery leader from
    #: tasks_task to tasks_finished (tasks/maintenance/archive.py), once their hour is in the history
    #: (10 to 70 minutes after they finish); None keeps every task in tasks_task.
    ARCHIVE_AFTER: Any = DEFAULT_ARCHIVE_AFTER
    #: Share of the time the recovery leader's mover thread works while it is behind (a pass not
    #: done within its slice of MOVER_SLICE seconds); above 0, at most 1 (flat out).
    ARCHIVE_BUSY_FRACTION: float = DEFAULT_ARCHIVE_BUSY_FRACTION
    #: Periodic tasks (tasks/maintenance/scheduler.py): name -> {"task", "cron" or "interval", "args", "kwargs",
    #: "queue", "priority", "catch_up", "timezone", "grace", "max_attempts", "timeout", "enabled"}.
    SCHEDULES: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Lease TTL of the (leader-elected) scheduler: a standby takes over within about this long.
    SCHEDULER_TTL: float = 10.0
    #: Slots one schedule may enqueue per scheduler round when catching up with "all".
    SCHEDULER_MAX_CATCH_UP: int = 1000
    #: Queues routed to database aliases: queue name -> alias (others live in ``default``). See
    #: tasks/lifecycle/routing.py: enqueue, the API, the django.tasks backend, workers and schedules follow it.
    QUEUE_DATABASES: dict[str, str] = field(default_factory=dict)
    #: Database aliases reached through a transaction pooler (PgBouncer ``pool_mode = transaction``).
    #: A session there is not the worker's: a LISTEN would hold on whichever server connection ran it,
    #: and notifications would be lost with it, so workers of such an alias do not LISTEN through it.
    POOLED_DATABASES: tuple[str, ...] = ()
    #: A direct (unpooled) database URL per alias, for LISTEN only: workers of a pooled alias then
    #: still wake at once on an enqueue; without one they poll every POLL_INTERVAL.
    LISTEN_URLS: dict[str, str] = field(default_factory=dict)
    #: Run the hot paths' statements (enqueue, claim, start, finish, heartbeat) as server-side prepared
    #: statements on aliases not in POOLED_DATABASES (tasks/lifecycle/prepared.py).
    PREPARED_STATEMENTS: bool = True
    #: OpenTelemetry spans for enqueues and attempts (tasks/tracing.py, the ``otel`` extra). None (the
    #: default): on while a tracer provider is configured (the process imported opentelemetry and set
    #: one); True: always (opentelemetry-api must be installed); False: never (nothing of
    #: opentelemetry is imported, and a plain enqueue stores no trace context).
    TRACING: bool | None = None
    #: Argument keys hidden on every page, the admin and the API's task representations (matched
    #: case-insensitively at any depth of args and kwargs), or the dotted path of a callable
    #: ``f(task_path, args, kwargs) -> (args, kwargs)``: tasks/redaction.py. The row keeps the values.
    REDACT_ARGUMENTS: tuple[str, ...] | str = ()


# What get_settings() (and what is derived from it, e.g. the queue routes) built from the current
# ``settings.LEASING_TASKS`` object: an enqueue asks for it several times, and building it cost a
# tenth of a single enqueue's Python time. Keyed by the object's identity (a new dict, as
# override_settings and pytest-django's ``settings`` give, is seen at once) and emptied whenever
# Django reports LEASING_TASKS or DATABASES changed. A dict changed in place without either is not
# seen: settings are read-only at run time (Django's own documentation says so).
_derived: dict[str, Any] = {}


def _forget(*, setting: str, **_: Any) -> None:
    if setting in ("LEASING_TASKS", "DATABASES"):
        _derived.clear()


setting_changed.connect(_forget, dispatch_uid="tasks.conf.forget")


def derived(name: str, build: Callable[[], T]) -> T:
    """``build()``, remembered until LEASING_TASKS (or DATABASES) changes."""
    raw = getattr(settings, "LEASING_TASKS", None)
    if _derived.get("") is not raw or "" not in _derived:
        _derived.clear()
        _derived[""] = raw
    try:
        return _derived[name]
    except KeyError:
        value = _derived[name] = build()
        return value


def get_settings() -> TaskSettings:
    return derived("settings", _build_settings)


def _build_settings() -> TaskSettings:
    overrides: dict[str, Any] = dict(getattr(settings, "LEASING_TASKS", {}) or {})
    unknown = set(overrides) - {f.name for f in fields(TaskSettings)}
    if unknown:
        raise ValueError(f"unknown LEASING_TASKS settings: {', '.join(sorted(unknown))}")
    if isinstance(overrides.get("RETENTION"), dict):
        overrides["RETENTION"] = {**DEFAULT_RETENTION, **overrides["RETENTION"]}
    for name in ("API_TASKS", "API_TASK_PATTERNS", "POOLED_DATABASES", "FAIR_QUEUES"):
        if name in overrides:
            if isinstance(overrides[name], str):
                raise ValueError(f"LEASING_TASKS[{name!r}] must be a list of strings, not one string")
            overrides[name] = tuple(overrides[name])
    if "LISTEN_URLS" in overrides:
        urls = overrides["LISTEN_URLS"]
        if not isinstance(urls, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in urls.items()):
            raise ValueError("LEASING_TASKS['LISTEN_URLS'] must map database aliases to URLs (strings)")
    for pattern in overrides.get("API_TASK_PATTERNS", ()):
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ValueError(f"LEASING_TASKS['API_TASK_PATTERNS']: {pattern!r} is not a regex: {exc}") from None
    if isinstance(overrides.get("REDACT_ARGUMENTS"), list):
        overrides["REDACT_ARGUMENTS"] = tuple(overrides["REDACT_ARGUMENTS"])
    tracing = overrides.get("TRACING")
    if not (tracing is None or isinstance(tracing, bool)):
        raise ValueError("LEASING_TASKS['TRACING'] must be True, False or None (on while a tracer provider is set)")
    if tracing is True and importlib.util.find_spec("opentelemetry") is None:
        raise ValueError(
            "LEASING_TASKS['TRACING'] is True but OpenTelemetry is not installed: pip install 'django-leasing[otel]'"
        )
    return TaskSettings(**overrides)
