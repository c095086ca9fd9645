"""Which task paths may come through the JSON API.

A worker imports and calls a task's path, so a path from an API client is code execution chosen by
that client. It is accepted only when

1. it is a dotted path of public names (no segment starts with ``_``; matched with ``fullmatch``, so
   no trailing newline slips past a ``$``),
2. it is listed in ``LEASING_TASKS["API_TASKS"]`` or matches one of ``LEASING_TASKS["API_TASK_PATTERNS"]``
   (regular expressions, ``re.fullmatch``), and
3. it names a function, or a ``django.tasks`` Task, *defined* at module level in that module: not a
   class, not a module, not something the module imported (``tasks.demo.os``), not an alias.

:func:`refusal` checks 1 and 2 on the string alone, importing nothing; :func:`resolve` then imports
the module and checks 3. The API runs both at enqueue; a worker runs both again before it runs a
task that came through the API (with the settings it has then), so a row enqueued under an older,
looser list, or written to the table by hand, does not run code the list no longer admits.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from tasks.conf import get_settings
from tasks.exceptions import TaskPathRefused

_PATH = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?:\.[A-Za-z][A-Za-z0-9_]*)+")
MAX_PATH = 255


def refusal(path: Any) -> str | None:
    """Why ``path`` may not come through the API (None: the lists admit it). Imports nothing."""
    if not isinstance(path, str) or len(path) > MAX_PATH or not _PATH.fullmatch(path):
        return "task_path must be a dotted import path of public names (no leading underscores)"
    conf = get_settings()
    if path in conf.API_TASKS or any(re.fullmatch(pattern, path) for pattern in conf.API_TASK_PATTERNS):
        return None
    return "task_path is not allowed by LEASING_TASKS['API_TASKS'] or ['API_TASK_PATTERNS']"


def resolve(path: str) -> Any:
    """The function or django.tasks Task that ``path`` names, if the API may run it.

    Raises :class:`TaskPathRefused` when the lists do not admit the path or the object is not a
    public module-level function defined in its module; ``ImportError`` when the module does not import.
    """
    from tasks.compat import Task as DjangoTask

    reason = refusal(path)
    if reason is not None:
        raise TaskPathRefused(f"{path!r}: {reason}")
    module_name, _, name = path.rpartition(".")
    module = importlib.import_module(module_name)
    # vars(), not getattr(): no module __getattr__ hook, no descriptor runs for a name that is not there.
    target = vars(module).get(name)
    function = target.func if isinstance(target, DjangoTask) else target
    if not inspect.isfunction(function):
        kind = "nothing" if target is None else type(target).__name__
        raise TaskPathRefused(f"{path!r} names {kind}, not a function or django.tasks Task")
    if function.__module__ != module_name or function.__qualname__ != name:
        raise TaskPathRefused(
            f"{path!r} is {function.__module__}.{function.__qualname__},"
            f" not a function defined as {name} in {module_name}"
        )
    return target
