"""What is wrong with a backend's OPTIONS and a ``@task(...)``'s options, found when the settings are
checked (``LeaseBackend.check``) or the task's module is imported (``LeaseBackend.validate_task``):
each problem names the task path and the option, and nothing is enqueued with a wrong one. Key
templates (``str.format``, filled with the call's arguments) are refused when they can only fail or
would let the call choose the key's size (tests/db/test_key_template_attacks.py)."""

from __future__ import annotations

import _string
import re
import string
from collections.abc import Callable
from typing import Any

from tasks.backends.options import LeaseTask, seconds_of
from tasks.lifecycle import policy
from tasks.lifecycle.ratelimits import parse_rate
from tasks.lifecycle.windows import window_problems
from tasks.models import MAX_CONCURRENCY_LIMIT

OPTIONS = frozenset(
    {"database", "max_attempts", "timeout", "concurrency", "retry", "rate_limits", "unique", "debounce", "fair"}
)


def retry_problems(spec: Any) -> list[str]:
    """What is wrong with an OPTIONS["retry"] mapping (task path -> a retry policy of dotted paths)."""
    if not isinstance(spec, dict):
        return ["must be a mapping of task paths to {'max_attempts': ..., 'retry_on': [...], 'backoff': ...}"]
    return [
        f"{path!r} {problem}"
        for path, entry in spec.items()
        for problem in policy.policy_problems(entry, paths_only=True)
    ]


def concurrency_problems(spec: Any) -> list[str]:
    """What is wrong with an OPTIONS["concurrency"] mapping (task path -> {"key": ..., "limit": ...})."""
    if not isinstance(spec, dict):
        return ["must be a mapping of task paths to {'key': ..., 'limit': ...}"]
    problems = []
    for path, entry in spec.items():
        if not isinstance(entry, dict) or set(entry) != {"key", "limit"}:
            problems.append(f"{path!r}: give exactly 'key' (a str.format template) and 'limit'")
            continue
        key, limit = entry["key"], entry["limit"]
        if not isinstance(key, str) or not key:
            problems.append(f"{path!r}: 'key' must be a non-empty string")
        else:
            problems += [f"{path!r}: 'key' {problem}" for problem in _template_problems(key)]
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CONCURRENCY_LIMIT:
            problems.append(f"{path!r}: 'limit' must be a whole number from 1 to {MAX_CONCURRENCY_LIMIT}")
    return problems


def rate_limit_problems(spec: Any) -> list[str]:
    """What is wrong with an OPTIONS["rate_limits"] mapping (task path -> {"key": ..., "limit": "14/s"})."""
    if not isinstance(spec, dict):
        return ["must be a mapping of task paths to {'key': ..., 'limit': '14/s'}"]
    problems = []
    for path, entry in spec.items():
        if not isinstance(entry, dict) or set(entry) != {"key", "limit"}:
            problems.append(f"{path!r}: give exactly 'key' (a str.format template) and 'limit' (e.g. '14/s')")
            continue
        key = entry["key"]
        if not isinstance(key, str) or not key:
            problems.append(f"{path!r}: 'key' must be a non-empty string")
        else:
            problems += [f"{path!r}: 'key' {problem}" for problem in _template_problems(key)]
        try:
            parse_rate(entry["limit"])
        except ValueError as exc:
            problems.append(f"{path!r}: 'limit': {exc}")
    return problems


def window_spec_problems(spec: Any, kind: str) -> list[str]:
    """What is wrong with an OPTIONS["unique"] mapping (task path -> {"key": ..., "for": seconds}) or
    an OPTIONS["debounce"] one (task path -> {"key": ..., "delay": seconds, "max_wait": seconds})."""
    shape = "{'key': ..., 'for': seconds}" if kind == "unique" else "{'key': ..., 'delay': seconds, 'max_wait': ...}"
    if not isinstance(spec, dict):
        return [f"must be a mapping of task paths to {shape}"]
    problems = []
    for path, entry in spec.items():
        problems += [f"{path!r}: {problem}" for problem in window_problems(entry, kind)]
        key = entry.get("key") if isinstance(entry, dict) else None
        if isinstance(entry, dict) and (not isinstance(key, str) or not key):
            problems.append(f"{path!r}: 'key' must be a non-empty string")
        elif isinstance(key, str):
            problems += [f"{path!r}: 'key' {problem}" for problem in _template_problems(key)]
    return problems


def fair_problems(spec: Any) -> list[str]:
    """What is wrong with an OPTIONS["fair"] mapping (task path -> a key template)."""
    if not isinstance(spec, dict):
        return ["must be a mapping of task paths to key templates ('{customer_id}')"]
    problems = []
    for path, key in spec.items():
        if not isinstance(key, str) or not key:
            problems.append(f"{path!r}: the key template must be a non-empty string")
        else:
            problems += [f"{path!r}: the key template {problem}" for problem in _template_problems(key)]
    return problems


#: The longest concurrency key (the column): a field wider than this, or a longer precision, never fits.
MAX_KEY_LENGTH = 255


def _template_problems(template: str) -> list[str]:
    """A key template fills in the call's arguments (JSON values) by position, name or item
    (``{0}``, ``{customer_id}``, ``{0[id]}``): a template that fails every call (malformed, mixing
    ``{}`` with ``{0}``, text the database cannot store), one that reads attributes (``{0.__class__}``:
    JSON values have none worth a key), and one that lets the call choose the key's size is refused at
    startup. A format spec is fixed text with widths and precisions of at most ``MAX_KEY_LENGTH``: a
    nested field (``{0:>{1}}``) would take the width from the call, and one integer argument would
    make the key a gigabyte string (or a MemoryError) before its length is checked."""
    if "\x00" in template:
        return ["contains a NUL character (no key can hold one)"]
    try:
        template.encode()
    except UnicodeEncodeError:
        return ["contains a lone surrogate (no key can hold one)"]
    try:
        parts = [(field, spec, conv) for _text, field, spec, conv in string.Formatter().parse(template)]
    except ValueError as exc:
        return [f"is not a valid str.format template: {exc}"]
    problems = []
    numbering = set()
    for field, spec, conversion in parts:
        if field is None:
            continue
        try:
            first, rest = _string.formatter_field_name_split(field)
            lookups = list(rest)
        except ValueError as exc:
            problems.append(f"has a malformed field {{{field}}}: {exc}")
            continue
        numbering.add("automatic ({})" if first == "" else "manual ({0})" if isinstance(first, int) else "by name")
        if conversion not in (None, "r", "s", "a"):
            problems.append(f"has an unknown conversion !{conversion} (only !r, !s and !a exist)")
        if any(is_attribute for is_attribute, _name in lookups):
            problems.append(f"reads an attribute ({{{field}}}): use an argument or an item ({{0[key]}})")
        if spec and "{" in spec:
            problems.append(
                f"takes a format spec from the call ({{{field}:{spec}}}): the arguments would choose the key's "
                "size; write the spec out"
            )
        elif spec and any(int(digits) > MAX_KEY_LENGTH for digits in re.findall(r"\d+", spec)):
            problems.append(
                f"asks for a width or precision over {MAX_KEY_LENGTH} ({{{field}:{spec}}}): a key is at most "
                f"{MAX_KEY_LENGTH} characters"
            )
    if "automatic ({})" in numbering and "manual ({0})" in numbering:
        problems.append("mixes automatic ({}) and manual ({0}) field numbering: str.format refuses every call")
    return problems


_WINDOWS_HINT = "See docs/howto/pausing-and-keys.md (windows)."
#: The per-task-path mappings of OPTIONS and their checks: (option, its problems, hint, check id).
OPTION_CHECKS: tuple[tuple[str, Callable[[Any], list[str]], str, str], ...] = (
    ("concurrency", concurrency_problems, "See docs/howto/pausing-and-keys.md.", "tasks.E012"),
    ("rate_limits", rate_limit_problems, "See docs/howto/rate-limits.md.", "tasks.E015"),
    ("unique", lambda spec: window_spec_problems(spec, "unique"), _WINDOWS_HINT, "tasks.E014"),
    ("debounce", lambda spec: window_spec_problems(spec, "debounce"), _WINDOWS_HINT, "tasks.E014"),
    ("fair", fair_problems, "See docs/howto/pausing-and-keys.md, 'Fair queues'.", "tasks.E016"),
    ("retry", retry_problems, "See docs/howto/retries.md.", "tasks.E013"),
)


def task_option_problems(task: LeaseTask) -> list[str]:
    """What is wrong with the options of a ``@task(...)`` (tasks/backends/options.py), each naming the
    option: the checks of the OPTIONS mappings, on a one-entry mapping of this task."""
    path = task.module_path
    problems: list[str] = []
    for name in ("max_attempts", "retry_on", "backoff"):
        try:
            policy.stored(**{name: getattr(task, name)})
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
    if task.timeout is not None and (
        isinstance(task.timeout, bool) or not isinstance(task.timeout, int | float) or not 0 < task.timeout < 10**7
    ):
        problems.append(f"timeout must be a number of seconds above 0, not {task.timeout!r}")
    pairs = (
        ("concurrency_key", "concurrency_limit", concurrency_problems),
        ("rate_key", "rate_limit", rate_limit_problems),
    )
    for key_name, limit_name, problems_of in pairs:
        key, limit = getattr(task, key_name), getattr(task, limit_name)
        if (key is None) != (limit is None):
            problems.append(f"{key_name} and {limit_name} go together: give both or neither")
        elif key is not None:
            found = problems_of({path: {"key": key, "limit": limit}})
            problems += [
                p.replace(f"{path!r}: 'key'", key_name).replace(f"{path!r}: 'limit'", limit_name) for p in found
            ]
    if task.unique_for is not None and task.debounce is not None:
        problems.append("unique_for and debounce exclude each other: a key is unique for a period or debounced")
    elif task.unique_for is not None or task.debounce is not None:
        if task.dedup_key is None:
            problems.append("unique_for and debounce need dedup_key (the window's key template)")
        else:
            kind = "unique" if task.unique_for is not None else "debounce"
            entry = (
                {"key": task.dedup_key, "for": seconds_of(task.unique_for)}
                if kind == "unique"
                else {"key": task.dedup_key, "delay": seconds_of(task.debounce), "max_wait": seconds_of(task.max_wait)}
            )
            if kind == "debounce" and entry["max_wait"] is None:
                del entry["max_wait"]
            problems += [p.replace(f"{path!r}: ", "") for p in window_spec_problems({path: entry}, kind)]
    elif task.max_wait is not None:
        problems.append("max_wait goes with debounce")
    elif task.dedup_key is not None:
        problems.append("dedup_key is the key of a window: give unique_for or debounce with it")
    if task.fair_key is not None:
        problems += [p.replace(f"{path!r}: ", "") for p in fair_problems({path: task.fair_key})]
    return problems
