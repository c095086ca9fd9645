from __future__ import annotations

import datetime as dt
import json as _json
from typing import Any

from django import template
from django.db import DEFAULT_DB_ALIAS
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html

from leasing.routing import database_query, known_databases

register = template.Library()

#: What a page shows for no value (an en dash).
NONE_SHOWN = "\u2013"


@register.filter
def ago(value: dt.datetime | None) -> str:
    """Seconds matter on a lease dashboard: "3.2 s ago", "4 min ago", "2 h ago"."""
    if value is None:
        return "-"
    seconds = (timezone.now() - value).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 60:
        text = f"{seconds:.1f} s"
    elif seconds < 3600:
        text = f"{seconds / 60:.0f} min"
    elif seconds < 86400:
        text = f"{seconds / 3600:.0f} h"
    else:
        text = f"{seconds / 86400:.0f} d"
    return f"in {text}" if future else f"{text} ago"


def _as_datetime(value: Any) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value
    if isinstance(value, str):  # a time kept in jsonb (an error entry's "at")
        return parse_datetime(value)
    return None


@register.filter
def stamp(value: Any) -> str:
    """Every page's one format for a time, its zone stated: ``2026-11-25 16:04:05 UTC`` ("" for none,
    so that ``|default:`` (a dash) applies). Takes a datetime or an ISO 8601 string."""
    moment = _as_datetime(value)
    if moment is None:
        return ""
    if timezone.is_naive(moment):
        moment = timezone.make_aware(moment, dt.timezone.utc)  # dt.UTC is Python 3.11+
    moment = timezone.localtime(moment)
    return f"{moment:%Y-%m-%d %H:%M:%S} {moment.tzname()}"


@register.filter
def when(value: Any) -> str:
    """A relative time ("4 min ago") with the absolute one (:func:`stamp`) in its title."""
    moment = _as_datetime(value)
    if moment is None:
        return NONE_SHOWN
    return format_html('<span title="{}">{}</span>', stamp(moment), ago(moment))


@register.filter
def json(value: Any) -> str:
    """A jsonb value as JSON on one line (``{"sent": 7}``, never Python's ``{'sent': 7}``); a dash for none.
    Autoescaping escapes it like any text."""
    if value is None:
        return NONE_SHOWN
    return _json.dumps(value, ensure_ascii=False, default=str)


@register.filter
def json_pretty(value: Any) -> str:
    """A jsonb value as indented JSON (for a ``<pre>``); a dash for none."""
    if value is None:
        return NONE_SHOWN
    return _json.dumps(value, ensure_ascii=False, indent=2, default=str)


# -- the database a page shows (``?db=``, leasing/routing.py) ----------------------------------


def _page_database(context: template.Context) -> str:
    request = context.get("request")
    return getattr(request, "leasing_database", DEFAULT_DB_ALIAS)


@register.simple_tag(takes_context=True)
def db_q(context: template.Context) -> str:
    """``?db=alias`` to start a link's query string with, or nothing on the default database."""
    query = database_query(_page_database(context))
    return f"?{query}" if query else ""


@register.simple_tag(takes_context=True)
def db_amp(context: template.Context) -> str:
    """``&db=alias`` to add to a link that has a query string already, or nothing."""
    query = database_query(_page_database(context))
    return f"&{query}" if query else ""


@register.simple_tag(takes_context=True)
def db_hidden(context: template.Context) -> str:
    """A hidden ``db`` field for GET forms, so a search stays on the database shown."""
    alias = _page_database(context)
    if alias == DEFAULT_DB_ALIAS:
        return ""
    return format_html('<input type="hidden" name="db" value="{}">', alias)


@register.inclusion_tag("leasing/_database.html", takes_context=True)
def database_switcher(context: template.Context) -> dict[str, Any]:
    """Which database the page shows, and links to the same page on the others."""
    request = context.get("request")
    current = _page_database(context)
    path = request.path if request is not None else ""
    others = [
        {"alias": alias, "url": f"{path}?{database_query(alias)}" if alias != DEFAULT_DB_ALIAS else path}
        for alias in known_databases()
        if alias != current
    ]
    return {"current": current, "others": others}
