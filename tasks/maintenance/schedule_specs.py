"""Schedules declared in settings (``LEASING_TASKS["SCHEDULES"]``) or stored in the database
(:class:`~tasks.models.schedule.StoredSchedule`, written from the admin and the JSON API), validated
by one function (:func:`build_spec`), and their slots.

A slot is a time a schedule is due. An ``interval`` schedule is due at every multiple of the
interval since the Unix epoch (UTC), so replicas agree on the slots whatever time they started; a
``cron`` schedule is due when its expression matches in the schedule's time zone, as Debian's cron
would run it: cronsim evaluates the expression (daylight-saving changes included; day-of-month and
day-of-week are ORed when both are restricted). See ``tasks/maintenance/scheduler.py`` for who enqueues them.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from tasks.conf import get_settings
from tasks.exceptions import UnstorableResult
from tasks.lifecycle.storable import storable_json
from tasks.lifecycle.values import fair_key_for

CATCH_UP = ("skip", "last", "all")
DEFAULT_CATCH_UP = "last"
DEFAULT_GRACE = 60.0
#: Most slots counted one by one to report how many a cron schedule skipped ("at least" beyond).
SKIP_COUNT_CAP = 10_000

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$")
_KEYS = {
    "task",
    "cron",
    "interval",
    "args",
    "kwargs",
    "queue",
    "priority",
    "catch_up",
    "timezone",
    "grace",
    "max_attempts",
    "timeout",
    "enabled",
    "fair_key",
}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
#: Longest interval (100 years): its slots stay far inside what a datetime holds (a longer one made
#: the leader's arithmetic overflow and the scheduler thread end). Longer periods are a cron's.
MAX_INTERVAL = 100 * 365.25 * 86_400
#: The task row's max_attempts column (a PostgreSQL integer).
MAX_ATTEMPTS_COLUMN = 2**31 - 1
#: A stored schedule is a standing enqueue over the web: POST /api/tasks's bounds (tasks/web/api/tasks.py).
STORED_MAX_ATTEMPTS = 1000
STORED_MAX_TIMEOUT = 86_400.0
_MICROSECOND = dt.timedelta(microseconds=1)


def _micros(moment: dt.datetime) -> int:
    return (moment - _EPOCH) // _MICROSECOND


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule from settings, validated."""

    name: str
    task_path: str
    cron: str | None = None
    interval: float | None = None
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    queue: str = "default"
    priority: int = 0
    catch_up: str = DEFAULT_CATCH_UP
    timezone: str = "UTC"
    grace: float = DEFAULT_GRACE
    max_attempts: int | None = None
    timeout: float | None = None
    enabled: bool = True
    fair_key: str | None = None  # its tasks' key in a fair queue (None: the shared key "")
    #: A stored schedule's row revision this spec was read at (None: declared in settings). The
    #: scheduler's slot statement refuses to enqueue when the row has moved on (edited, paused, deleted).
    revision: int | None = None
    #: With ``revision``, which row: its ``created_at``. A schedule deleted and stored again under
    #: its name is a new row; the slot statement must not take it for the old one.
    stored_at: dt.datetime | None = None

    @property
    def stored(self) -> bool:
        return self.revision is not None

    @property
    def every(self) -> str:
        """The cadence, for people: the cron expression or "every N s"."""
        if self.cron is not None:
            return f"{self.cron} ({self.timezone})"
        assert self.interval is not None
        return f"every {self.interval:g} s"

    def explain(self) -> str:
        if self.cron is None:
            return self.every
        try:
            return CronSim(self.cron, dt.datetime.now(ZoneInfo(self.timezone))).explain()
        except Exception:  # explain() is a nicety; the expression itself was validated
            return self.every

    def definition(self) -> dict[str, Any]:
        """What the scheduler runs, stored on the schedule row (the dashboard and API show it)."""
        return {
            "task": self.task_path,
            "cron": self.cron,
            "interval": self.interval,
            "timezone": self.timezone if self.cron else None,
            "args": self.args,
            "kwargs": self.kwargs,
            "queue": self.queue,
            "priority": self.priority,
            "catch_up": self.catch_up,
            "grace": self.grace,
            "max_attempts": self.max_attempts,
            "timeout": self.timeout,
            "enabled": self.enabled,
            **({"fair_key": self.fair_key} if self.fair_key is not None else {}),
        }

    # -- slots ---------------------------------------------------------------------------------

    def _step(self) -> int:
        assert self.interval is not None
        return max(1, round(self.interval * 1_000_000))

    def slots_after(self, after: dt.datetime) -> Iterator[dt.datetime]:
        """Every slot strictly after ``after``, in order (aware UTC datetimes, strictly increasing)."""
        if self.interval is not None:
            step = self._step()
            k = _micros(after) // step + 1
            while True:
                yield _EPOCH + dt.timedelta(microseconds=k * step)
                k += 1
        assert self.cron is not None
        zone = ZoneInfo(self.timezone)
        previous = after
        iterator = CronSim(self.cron, after.astimezone(zone))
        for moment in iterator:
            slot = moment.astimezone(dt.timezone.utc)
            # Debian cron runs a fixed-time job once in a repeated (autumn) hour, and cronsim
            # iterates such jobs on the wall clock: started inside the repeated hour, it may
            # answer a time already passed. Slots must only move forward.
            if slot > previous:
                previous = slot
                yield slot

    def next_slot(self, after: dt.datetime) -> dt.datetime:
        return next(self.slots_after(after))

    def latest_due(self, after: dt.datetime, now: dt.datetime) -> tuple[dt.datetime | None, int, bool]:
        """The newest slot in (after, now], how many slots before it in that range, and whether
        that count is exact (cron slots are counted one by one up to SKIP_COUNT_CAP)."""
        if self.interval is not None:
            step = self._step()
            first = _micros(after) // step + 1
            last = _micros(now) // step
            if last < first:
                return None, 0, True
            return _EPOCH + dt.timedelta(microseconds=last * step), last - first, True
        newest: dt.datetime | None = None
        counted = 0
        for slot in self.slots_after(after):
            if slot > now:
                return newest, max(counted - 1, 0), True
            newest = slot
            counted += 1
            if counted > SKIP_COUNT_CAP:
                break
        # A long backlog: find the newest slot from the other end (cronsim iterates backwards too).
        assert self.cron is not None
        zone = ZoneInfo(self.timezone)
        start = (now + dt.timedelta(seconds=1)).replace(microsecond=0).astimezone(zone)
        for moment in CronSim(self.cron, start, reverse=True):
            slot = moment.astimezone(dt.timezone.utc)
            if slot <= now:
                return slot, counted - 1, False
        return newest, counted - 1, False  # pragma: no cover (the reverse walk always finds one)


# -- settings ------------------------------------------------------------------------------------


#: Longest string a schedule's text fields may hold (task path, cron, time zone, queue, fair key).
MAX_TEXT = 255


class InvalidSchedule(ImproperlyConfigured):
    """A schedule entry that cannot run: ``key`` names the field at fault, ``reason`` says why.

    ``str()`` is the settings form (``LEASING_TASKS["SCHEDULES"]["name"]: reason``); the admin and
    the API show ``reason`` against ``key``."""

    def __init__(self, name: str, reason: str, key: str | None = None) -> None:
        super().__init__(f'LEASING_TASKS["SCHEDULES"]["{name}"]: {reason}' if key != "name" else reason)
        self.reason = reason
        self.key = key


def _fail(name: str, message: str, key: str | None = None) -> InvalidSchedule:
    return InvalidSchedule(name, message, key)


def _text(name: str, key: str, value: Any) -> str:
    """A short string PostgreSQL can store (no NUL)."""
    if not isinstance(value, str):
        raise _fail(name, f"{key} must be a string, got {type(value).__name__}", key)
    if len(value) > MAX_TEXT or "\x00" in value:
        raise _fail(name, f"{key} must be at most {MAX_TEXT} characters, without NUL", key)
    return value


def _number(name: str, key: str, value: Any, *, low: float, allow_equal: bool, high: float = float("inf")) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(name, f"{key} must be a number, got {value!r:.50}", key)
    if value < low or (value == low and not allow_equal) or value != value or value == float("inf"):
        raise _fail(name, f"{key} must be {'at least' if allow_equal else 'more than'} {low:g}, got {value!r}", key)
    if value > high:
        raise _fail(name, f"{key} must be at most {high:g}, got {value!r:.50}", key)
    return float(value)


def build_spec(name: str, entry: Any) -> ScheduleSpec:
    """Validate one settings entry. Raises ImproperlyConfigured saying what is wrong with it."""
    from tasks.backends.backend import LeaseBackend
    from tasks.compat import Task as DjangoTask

    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidSchedule(
            str(name)[:100],
            f"schedule name {name!r:.120}: use 1-100 letters, digits, '_', '.', ':' or '-'"
            " (starting with a letter or digit)",
            "name",
        )
    if not isinstance(entry, dict):
        raise _fail(name, "must be a dict", "entry")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise _fail(
            name,
            f"unknown key(s) {', '.join(u[:50] for u in map(str, unknown[:5]))} (known: {', '.join(sorted(_KEYS))})",
            "entry",
        )
    if "task" not in entry:
        raise _fail(name, "give the task: an import path or a django.tasks Task", "task")
    target = entry["task"]
    defaults: dict[str, Any] = {}
    if isinstance(target, str):
        _text(name, "task", target)
        try:
            resolved = import_string(target)
        except ImportError as exc:
            raise _fail(name, f"task {target!r} cannot be imported: {exc}", "task") from None
        if not callable(resolved) and not isinstance(resolved, DjangoTask):
            raise _fail(name, f"task {target!r} is not callable", "task")
        target = resolved if isinstance(resolved, DjangoTask) else target
    if isinstance(target, DjangoTask):
        task_path = target.module_path
        defaults = {"queue": target.queue_name, "priority": target.priority}
        backend = target.get_backend()
        if isinstance(backend, LeaseBackend):
            defaults.update(max_attempts=backend.max_attempts, timeout=backend.timeout)
    elif isinstance(target, str):
        task_path = target
    else:
        raise _fail(name, f"task must be an import path or a django.tasks Task, got {target!r:.100}", "task")

    has_cron, has_interval = entry.get("cron") is not None, entry.get("interval") is not None
    if has_cron == has_interval:
        raise _fail(name, "give exactly one of cron (an expression) or interval (seconds)", "cron")
    cron = interval = None
    zone_name = entry.get("timezone", settings.TIME_ZONE if settings.USE_TZ else "UTC") or "UTC"
    _text(name, "timezone", zone_name)
    try:
        zone = ZoneInfo(zone_name)
    except (ZoneInfoNotFoundError, ValueError, TypeError, OSError):
        raise _fail(name, f"unknown time zone {zone_name!r}", "timezone") from None
    if has_cron:
        cron = " ".join(_text(name, "cron", entry["cron"]).split())
        try:
            CronSim(cron, dt.datetime.now(zone))
        except CronSimError as exc:
            raise _fail(name, f"invalid cron expression {cron!r}: {exc}", "cron") from None
    else:
        interval = _number(name, "interval", entry["interval"], low=0.001, allow_equal=True, high=MAX_INTERVAL)

    args = entry.get("args", [])
    kwargs = entry.get("kwargs", {})
    if not isinstance(args, list | tuple):
        raise _fail(name, "args must be a list", "args")
    if not isinstance(kwargs, dict):
        raise _fail(name, "kwargs must be a dict", "kwargs")
    try:
        args = json.loads(storable_json(list(args)))
        kwargs = json.loads(storable_json(kwargs))
    except UnstorableResult as exc:
        raise _fail(name, f"args and kwargs must be storable as JSON: {exc}", "args") from None

    queue = entry.get("queue", defaults.get("queue", "default"))
    if not isinstance(queue, str) or not 0 < len(queue) <= 100 or "\x00" in queue:
        raise _fail(name, "queue must be a name of 1-100 characters", "queue")
    priority = entry.get("priority", defaults.get("priority", 0))
    if isinstance(priority, bool) or not isinstance(priority, int) or not -100 <= priority <= 100:
        raise _fail(name, "priority must be a whole number between -100 and 100", "priority")
    catch_up = entry.get("catch_up", DEFAULT_CATCH_UP)
    if catch_up not in CATCH_UP:
        raise _fail(name, f"catch_up must be one of {', '.join(CATCH_UP)}, got {catch_up!r:.50}", "catch_up")
    grace = _number(name, "grace", entry.get("grace", DEFAULT_GRACE), low=0, allow_equal=True)
    max_attempts = entry.get("max_attempts", defaults.get("max_attempts"))
    if max_attempts is not None and (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_ATTEMPTS_COLUMN
    ):
        raise _fail(name, f"max_attempts must be a whole number from 1 to {MAX_ATTEMPTS_COLUMN}", "max_attempts")
    timeout = entry.get("timeout", defaults.get("timeout"))
    if timeout is not None:
        timeout = _number(name, "timeout", timeout, low=0, allow_equal=False)
    enabled = entry.get("enabled", True)
    if not isinstance(enabled, bool):
        raise _fail(name, "enabled must be True or False", "enabled")
    fair_key = entry.get("fair_key")
    if fair_key is not None:
        _text(name, "fair_key", fair_key)
        try:
            fair_key_for(queue, fair_key, ())
        except ValueError as exc:
            raise _fail(name, str(exc), "fair_key") from None
    return ScheduleSpec(
        name=name,
        task_path=task_path,
        cron=cron,
        interval=interval,
        args=args,
        kwargs=kwargs,
        queue=queue,
        priority=priority,
        catch_up=catch_up,
        timezone=zone_name,
        grace=grace,
        max_attempts=max_attempts,
        timeout=timeout,
        enabled=enabled,
        fair_key=fair_key,
    )


def load_schedules() -> dict[str, ScheduleSpec]:
    """``LEASING_TASKS["SCHEDULES"]``, validated (raises ImproperlyConfigured)."""
    declared = get_settings().SCHEDULES
    if not isinstance(declared, dict):
        raise ImproperlyConfigured('LEASING_TASKS["SCHEDULES"] must be a dict: name -> schedule')
    return {name: build_spec(name, entry) for name, entry in declared.items()}


# -- stored in the database ----------------------------------------------------------------------


def stored_spec(name: str, entry: Any, *, paused: bool = False, revision: int | None = None) -> ScheduleSpec:
    """Validate a schedule stored in the database (admin, JSON API, and the scheduler reading it).

    The same checks as a settings entry (:func:`build_spec`, the one validator), and the two that a
    schedule written over the web needs on top: its name is not one of the settings' schedules
    (those stay read-only), and its task path is one the JSON API may enqueue
    (``tasks/backends/allowlist.py``: a stored schedule is a standing enqueue, so its tasks carry
    ``api_origin`` and the worker checks the path again before it runs one). Pausing is the row's
    ``paused`` column, not the settings' ``enabled`` key. Raises :class:`InvalidSchedule`."""
    from tasks.backends import allowlist
    from tasks.exceptions import TaskPathRefused

    if not isinstance(name, str) or not _NAME.fullmatch(name):
        build_spec(name, entry)  # raises the name's error
    if not isinstance(entry, dict):
        raise _fail(name, "must be a dict", "entry")
    if name in get_settings().SCHEDULES:
        raise _fail(name, "a schedule of this name is declared in settings (read-only)", "name")
    if "enabled" in entry:
        raise _fail(name, "a stored schedule is paused and resumed, not enabled: give paused", "enabled")
    task = entry.get("task")
    if task is not None:
        reason = allowlist.refusal(task)
        if reason is not None:
            raise _fail(name, reason.replace("task_path", "task"), "task")
        try:
            allowlist.resolve(task)
        except TaskPathRefused as exc:
            raise _fail(name, str(exc), "task") from None
        except Exception as exc:  # the module does not import: it could not run either
            raise _fail(name, f"task cannot be imported: {type(exc).__name__}", "task") from None
    spec = build_spec(name, {**entry, "enabled": not paused})
    if spec.max_attempts is not None and spec.max_attempts > STORED_MAX_ATTEMPTS:
        raise _fail(name, f"max_attempts must be a whole number from 1 to {STORED_MAX_ATTEMPTS}", "max_attempts")
    if spec.timeout is not None and spec.timeout > STORED_MAX_TIMEOUT:
        raise _fail(name, f"timeout must be at most {STORED_MAX_TIMEOUT:g} seconds", "timeout")
    return replace(spec, revision=revision)
