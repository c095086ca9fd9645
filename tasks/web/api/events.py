"""The body of an event sent through the JSON API (``POST /api/tasks/<id>/events`` and
``POST /api/workflows/<id>/events``): one reading, so that both refuse the same input alike."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from leasing.http import ApiError, Body
from tasks.lifecycle.storable import is_storable


def event_body(request: HttpRequest) -> tuple[str, Any]:
    """``name`` (required text) and ``payload`` (any JSON PostgreSQL can store; absent: null), and
    nothing else; 400 with the field at fault otherwise, before anything is read or stored."""
    from tasks import steps

    body = Body(request)
    body.only("name", "payload")
    name = body.text("name", max_length=steps.MAX_EVENT_NAME)
    payload = body.data.get("payload")
    if not is_storable(payload):
        raise ApiError(400, "payload cannot be stored as JSON (NaN, infinity, NUL or a lone surrogate)", "payload")
    return name, payload
