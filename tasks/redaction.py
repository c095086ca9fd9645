"""Secrets in task arguments, hidden wherever a person or a client other than the worker reads them.

``LEASING_TASKS["REDACT_ARGUMENTS"]`` is either a list of key names, matched case-insensitively at any
depth of ``args`` and ``kwargs`` (a dict's value under such a key becomes ``"[redacted]"``, whatever
it holds), or the dotted path of a callable ``f(task_path, args, kwargs) -> (args, kwargs)`` that
returns what may be shown. Applied by the dashboard, the admin, the JSON API's task representations
and the schedule pages and API; the stored row is untouched and the worker (and an API client
claiming a task to run it) gets the real values. A callable that raises, or returns anything but
(a list, a dict) that JSON can hold, hides every argument (fails closed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.utils.module_loading import import_string

from tasks.conf import derived, get_settings

REDACTED = "[redacted]"

Redactor = Callable[[str, list[Any], dict[str, Any]], tuple[list[Any], dict[str, Any]]]


def setting_problem(value: Any) -> str | None:
    """What is wrong with a REDACT_ARGUMENTS value (None: nothing); the system check tasks.E121 says it."""
    if isinstance(value, str):
        try:
            found = import_string(value)
        except ImportError as exc:
            return f"is a string, so the dotted path of a callable, but {value!r} cannot be imported: {exc}"
        if not callable(found):
            return f"names {value!r}, which is not callable"
        return None
    if not isinstance(value, list | tuple):
        return f"must be a list of key names or the dotted path of a callable, not {type(value).__name__}"
    bad = [name for name in value if not isinstance(name, str) or not name]
    if bad:
        return f"holds {bad[0]!r}: each key name must be a non-empty string"
    return None


def _build() -> Redactor | frozenset[str] | None:
    value = get_settings().REDACT_ARGUMENTS
    if isinstance(value, str):
        return import_string(value)
    names = frozenset(name.casefold() for name in value)
    return names or None


def _rule() -> Redactor | frozenset[str] | None:
    return derived("redaction", _build)


def active() -> bool:
    return _rule() is not None


def _hide(value: Any, names: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {
            key: REDACTED if isinstance(key, str) and key.casefold() in names else _hide(item, names)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_hide(item, names) for item in value]
    return value


def redact(task_path: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """(args, kwargs) as they may be shown: the setting applied (copies; the inputs are not changed)."""
    rule = _rule()
    if rule is None:
        return args, kwargs
    if isinstance(rule, frozenset):
        return _hide(args, rule), _hide(kwargs, rule)
    try:
        shown_args, shown_kwargs = rule(task_path, list(args or []), dict(kwargs or {}))
        if not isinstance(shown_args, list | tuple) or not isinstance(shown_kwargs, dict):
            raise TypeError("a redactor returns (a list, a dict)")
        json.dumps([shown_args, shown_kwargs])  # what the pages and the API render: JSON, or hidden
    except Exception:
        return [REDACTED for _ in args or []], dict.fromkeys(kwargs or {}, REDACTED)
    return list(shown_args), shown_kwargs


def arguments(task: Any) -> dict[str, Any]:
    """``{"args": …, "kwargs": …}`` of a task (or any row with task_path, args, kwargs), redacted."""
    args, kwargs = redact(task.task_path, task.args, task.kwargs)
    return {"args": args, "kwargs": kwargs}


def value(task_path: str, shown: Any) -> Any:
    """A value a task's code produced and a page shows (a durable step's result), redacted as its
    arguments are: the named keys hidden at any depth, or the redactor's verdict on it as the one
    positional argument (hidden whole when the redactor fails)."""
    rule = _rule()
    if rule is None:
        return shown
    if isinstance(rule, frozenset):
        return _hide(shown, rule)
    args, _kwargs = redact(task_path, [shown], {})
    return args[0] if args else REDACTED


def definition(entry: Any) -> Any:
    """A schedule's entry or definition (a dict with ``task``, ``args``, ``kwargs``, ...) as it may be
    shown: a copy with its arguments redacted as its tasks' are."""
    if _rule() is None or not isinstance(entry, dict) or not ({"args", "kwargs"} & entry.keys()):
        return entry
    args, kwargs = redact(str(entry.get("task") or ""), entry.get("args"), entry.get("kwargs"))
    shown = dict(entry)
    if "args" in entry:
        shown["args"] = args
    if "kwargs" in entry:
        shown["kwargs"] = kwargs
    return shown


def holds_placeholder(value: Any) -> bool:
    """Whether ``"[redacted]"`` is somewhere in ``value``: what a client read back from the API and
    would store in place of the hidden value if a write took it."""
    if isinstance(value, dict):
        return any(holds_placeholder(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(holds_placeholder(item) for item in value)
    return value == REDACTED


def hides_part_of(args: Any = None, kwargs: Any = None) -> bool:
    """Whether redaction may hide part of this search value (a containment term): searching it would
    tell whether a hidden value is the one guessed, so such a search is refused. Named keys are
    checked as they are; a callable may hide by task path, which a search over every path cannot
    know, so with a callable every argument search is refused."""
    rule = _rule()
    if rule is None:
        return False
    if not isinstance(rule, frozenset):
        return True
    args = [] if args is None else args
    kwargs = {} if kwargs is None else kwargs
    return redact("", args, kwargs) != (args, kwargs)


_ABSENT = object()


def keep_hidden(value: Any, stored_entry: dict[str, Any], key: str) -> Any:
    """``value``, a form's edit of ``stored_entry[key]`` (``"args"`` or ``"kwargs"``) as
    :func:`definition` showed it, with each ``"[redacted]"`` left where the page showed one put back
    to the stored value there: a save of the page keeps the secrets it did not show. Raises
    ValueError naming the place of a ``"[redacted]"`` anywhere else (nothing hidden there to keep):
    stored, the task would get the placeholder in place of an argument."""
    shown = definition(stored_entry).get(key, _ABSENT) if isinstance(stored_entry, dict) else _ABSENT
    stored = stored_entry.get(key, _ABSENT) if isinstance(stored_entry, dict) else _ABSENT
    return _keep(value, shown, stored, key)


def _keep(value: Any, shown: Any, stored: Any, where: str) -> Any:
    if isinstance(value, str) and value == REDACTED:
        if isinstance(shown, str) and shown == REDACTED and stored is not _ABSENT:
            return stored
        raise ValueError(f"{where} holds {REDACTED!r} where no argument is hidden")
    if isinstance(value, dict):
        return {
            name: _keep(
                item,
                shown.get(name, _ABSENT) if isinstance(shown, dict) else _ABSENT,
                stored.get(name, _ABSENT) if isinstance(stored, dict) else _ABSENT,
                f"{where}[{json.dumps(name)}]",
            )
            for name, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [
            _keep(
                item,
                shown[index] if isinstance(shown, list | tuple) and index < len(shown) else _ABSENT,
                stored[index] if isinstance(stored, list | tuple) and index < len(stored) else _ABSENT,
                f"{where}[{index}]",
            )
            for index, item in enumerate(value)
        ]
    return value
