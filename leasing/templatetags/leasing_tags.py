from __future__ import annotations

import datetime as dt

from django import template
from django.utils import timezone

register = template.Library()


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
