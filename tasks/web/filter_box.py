"""The one box of ``/dashboard/tasks/``: ``name:value`` tokens for the page's filters, the rest the
search; and the chips that add or remove one filter each.

The box is a view of the query string, not a second way to filter: a ``q`` holding tokens is
answered with a redirect to the URL whose parameters they name (:func:`lift`), so the listing, its
pager, the bulk actions and every link keep reading the parameters alone (tasks/web/all_tasks.py).
The page shows the filters back in the box (:func:`box_text`), so that what is submitted again is
what is shown.

Grammar: a token is a filter's name (exactly as its query parameter), a colon, and a value running
to the next space, or in double quotes (``queue:"a b"``; ``\\"`` and ``\\\\`` inside them). Only
the first colon splits (``enqueued_after:2026-01-31T09:30:00Z``, ``rate_key:acme:eu``). ``status``
adds (a comma list, or repeated); any other filter replaces its parameter, and an empty value
(``queue:``) removes it. A word that names no filter (a worker id ``vm:4242:demo``) stays in the
search, and so does everything from an argument search on (``kwargs:{…}``, ``args:[…]``: JSON may
hold anything a token looks like).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.http import QueryDict

from leasing.validation import InvalidInput
from tasks.web.argument_search import INDEXES

#: The filters the box takes, in the order the box and the chips show them (query parameter names).
FILTERS: tuple[str, ...] = (
    "status",
    "queue",
    "task_path",
    "workflow",
    "dedup_key",
    "concurrency_key",
    "rate_key",
    "fair_key",
    "debounce_key",
    "enqueued_after",
    "enqueued_before",
)
#: A parameter that, left over from another page, would start the new filter part-way down.
_PAGER = "before"

_NAME = re.compile(r"([A-Za-z_]+):")
_WORD = re.compile(r"\S+")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"(?=\s|$)', re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)


def split(text: str) -> tuple[list[tuple[str, str]], str]:
    """The ``(name, value)`` tokens of a box's text, in order, and the search left (the text between
    them, each run stripped, joined by one space). Raises InvalidInput for a quote left open."""
    tokens: list[tuple[str, str]] = []
    rest: list[str] = []
    kept_from = position = 0
    while True:
        word = _WORD.search(text, position)
        if word is None:
            break
        start = word.start()
        named = _NAME.match(text, start)
        if named is not None and named.group(1).lower() in INDEXES:
            break  # an argument search: the rest of the text is its JSON
        if named is None or named.group(1) not in FILTERS:
            position = word.end()
            continue
        name, value_at = named.group(1), named.end()
        if text.startswith('"', value_at):
            quoted = _QUOTED.match(text, value_at)
            if quoted is None:
                raise InvalidInput(f'q: the quoted value of {name}: needs its closing " (then a space)', "q")
            value, end = _ESCAPE.sub(r"\1", quoted.group(1)), quoted.end()
        else:
            end = word.end()
            value = text[value_at:end]
        rest.append(text[kept_from:start])
        tokens.append((name, value))
        kept_from = position = end
    rest.append(text[kept_from:])
    return tokens, " ".join(part.strip() for part in rest if part.strip())


def lift(params: QueryDict) -> QueryDict | None:
    """The query string with the box's tokens moved to their own parameters (None: ``q`` holds
    none). Every other parameter is kept (``db``, the pager's ``before``)."""
    tokens, search = split(params.get("q") or "")
    if not tokens:
        return None
    query = params.copy()
    statuses = [text for text in query.getlist("status") if text.strip()]
    for name, value in tokens:
        if name == "status":
            statuses += [part.strip() for part in value.split(",") if part.strip()]
        elif value.strip():
            query[name] = value
        else:
            query.pop(name, None)
    _set_statuses(query, list(dict.fromkeys(statuses)))
    if search:
        query["q"] = search
    else:
        query.pop("q", None)
    return query


def _set_statuses(query: QueryDict, statuses: list[str]) -> None:
    if statuses:
        query.setlist("status", statuses)
    else:
        query.pop("status", None)


def quoted(value: str) -> str:
    """``value`` as the box reads it back: bare, or quoted when it holds a space or starts with one."""
    if value and not any(c.isspace() for c in value) and not value.startswith('"'):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def box_text(params: QueryDict, status_labels: list[str]) -> str:
    """What the box shows: a token per filter set (``status_labels``: the statuses read, as labels),
    then the search."""
    tokens = [f"status:{label}" for label in status_labels]
    for name in FILTERS[1:]:
        value = (params.get(name) or "").strip()
        if value:
            tokens.append(f"{name}:{quoted(value)}")
    search = (params.get("q") or "").strip()
    return " ".join([*tokens, search] if search else tokens)


@dataclass(frozen=True)
class Chip:
    """One link of the page's filter row: ``text`` shown, ``on`` when its filter is set (the link
    removes it), else the link adds it; ``key`` names it for tests and styles."""

    key: str
    text: str
    on: bool
    href: str


def _href(path: str, query: QueryDict) -> str:
    query.pop(_PAGER, None)  # a changed filter starts at the newest page
    encoded = query.urlencode()
    return f"{path}?{encoded}" if encoded else path


def status_chips(path: str, params: QueryDict, status_labels: list[str], labels: list[str]) -> list[Chip]:
    """A chip per status (``labels``, in order) toggling it in the query: ``status_labels`` are the
    statuses selected now."""
    chips = []
    for label in labels:
        on = label in status_labels
        query = params.copy()
        _set_statuses(query, [s for s in status_labels if s != label] if on else [*status_labels, label])
        chips.append(Chip(label, label, on, _href(path, query)))
    return chips


def filter_chips(path: str, params: QueryDict) -> list[Chip]:
    """A chip per filter set other than the statuses (the search too), each linking to the query
    without it."""
    chips = []
    for name in (*FILTERS[1:], "q"):
        value = (params.get(name) or "").strip()
        if value:
            query = params.copy()
            query.pop(name)
            text = f"search: {value}" if name == "q" else f"{name}:{quoted(value)}"
            chips.append(Chip(name, text, True, _href(path, query)))
    return chips
