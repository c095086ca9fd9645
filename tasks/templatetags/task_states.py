"""The task vocabulary in templates (tasks/lifecycle/vocabulary.py): one badge and one label per state,
and the action buttons that fit a set of statuses."""

from __future__ import annotations

import re
from typing import Any

from django import template
from django.utils.html import conditional_escape, format_html
from django.utils.safestring import SafeString, mark_safe

from tasks.lifecycle import vocabulary
from tasks.lifecycle.states import TaskStatus

register = template.Library()


@register.filter
def state_label(key: Any) -> str:
    """``READY`` -> ``Ready``, ``stuck`` -> ``Stuck``."""
    return vocabulary.label(str(key))


def _badge(state: vocabulary.State, element_id: str = "") -> SafeString:
    if element_id:
        return format_html(
            '<span class="status status-{}" data-state="{}" id="{}">{}</span>',
            state.key,
            state.key,
            element_id,
            state.label,
        )
    return format_html('<span class="status status-{}" data-state="{}">{}</span>', state.key, state.key, state.label)


@register.filter
def task_badge(task: Any) -> SafeString:
    """A task's one state (its view if it is in one), as a badge."""
    return _badge(vocabulary.state_of(task))


@register.simple_tag
def status_badge(key: Any, element_id: str = "") -> SafeString:
    """A status (or view) named by its key, as a badge: a workflow's, a schedule run's."""
    key = str(key)
    state = vocabulary.STATES.get(key) or vocabulary.State(key, key, "", key)
    return _badge(state, element_id)


@register.simple_tag
def actions_for(*statuses: Any) -> list[vocabulary.Action]:
    """The actions that fit every status given (a status, or a list of them)."""
    flat: list[str] = []
    for status in statuses:
        if isinstance(status, list | tuple | set):
            flat.extend(str(s) for s in status)
        else:
            flat.append(str(status))
    return vocabulary.actions_for(flat)


@register.simple_tag
def demo_installed() -> bool:
    """Whether the demo app (its generator pages) is installed: tasks/demo."""
    from tasks import demo

    return demo.installed()


@register.filter
def state_labels(keys: Any) -> str:
    """A list of statuses as their labels, comma-separated; anything else as its label."""
    if isinstance(keys, list | tuple):
        return ", ".join(vocabulary.label(str(key)) for key in keys)
    return vocabulary.label(str(keys))


#: Worker counters and chart series named after an outcome (machine names: metrics, the API) as
#: the pages name that outcome.
_COUNTER_NAMES = {"succeeded": "successful"}


@register.filter
def counter_name(key: Any) -> str:
    return _COUNTER_NAMES.get(str(key), str(key))


@register.filter
def error_class(entry: Any) -> str:
    """An error entry's exception class (a discard's entry names it ``type``)."""
    if not isinstance(entry, dict):
        return "error"
    return str(entry.get("exception_class_path") or entry.get("type") or entry.get("kind") or "error")


@register.filter
def cancelled_for_a_dependency(task: Any) -> bool:
    """Whether a CANCELLED task was cancelled because a task it depends on failed or was cancelled
    (its last entry is the workflow settlement's, kind ``dependency``), not by an operator or its handler."""
    errors = getattr(task, "errors", None) or []
    entry = errors[-1] if errors and isinstance(errors[-1], dict) else None
    return task.status == TaskStatus.CANCELLED and entry is not None and entry.get("kind") == "dependency"


#: How much of an error's message a list shows; the task's page has it whole.
ERROR_SUMMARY_CHARS = 120


@register.filter
def last_error(task: Any) -> SafeString:
    """The newest error entry of a task as its class and the start of its message ("" for none)."""
    errors = getattr(task, "errors", None) or []
    entry = errors[-1] if errors and isinstance(errors[-1], dict) else None
    if entry is None:
        return SafeString("")
    kind = error_class(entry)
    message = str(entry.get("message") or "")
    short = message if len(message) <= ERROR_SUMMARY_CHARS else message[: ERROR_SUMMARY_CHARS - 1] + "…"
    return format_html(
        '<span class="error-summary" title="{}"><span class="mono">{}</span>{}{}</span>',
        message,
        kind,
        ": " if short else "",
        short,
    )


@register.filter
def attempts_cell(task: Any) -> str:
    """A task's attempts as an operator reads them: ``1/3`` (attempts begun / allowed), but a claimed
    task whose attempt has not begun yet (``attempt_started`` false: prefetched, or its start not
    recorded yet) reads "claimed, starting", never "0/3", which reads as a stall."""
    if task.status == TaskStatus.RUNNING and not task.attempt_started:
        return format_html(
            '<span class="claimed" title="claimed by a worker; its attempt has not begun yet'
            ' ({} begun before, {} allowed)">claimed, starting</span>',
            task.attempts,
            task.max_attempts,
        )
    return f"{task.attempts}/{task.max_attempts}"


#: The characters an identifier breaks after when its cell is narrower than it: the separators of a
#: task path (``app.tasks.send``), a worker id (``name:suffix``), a queue or key (``a-b_c/d``).
#: None of them is changed by escaping, and no entity escaping writes holds one.
_SEPARATOR = re.compile(r"([./:_-])")


@register.filter
def breakable(value: Any) -> SafeString:
    """``value`` escaped, with a line-break opportunity (``<wbr>``) after each separator: a narrow
    column breaks ``tests.testapp.handlers.noop`` at its dots rather than inside a word
    (``defaul|t``), which it still does for a single word longer than the column."""
    return mark_safe(_SEPARATOR.sub(r"\1<wbr>", conditional_escape("" if value is None else str(value))))
