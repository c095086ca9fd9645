"""The OpenAPI document's building blocks (tasks/web/api/openapi/): the fields, parameters and
error its schemas and paths share, and the helpers that write an operation, a request body and an
answer object (``_object``: every field required but the conditional ones)."""

from __future__ import annotations

from typing import Any

from tasks.lifecycle.windows import MAX_WINDOW_SECONDS

STRING = {"type": "string", "minLength": 1, "maxLength": 255}
HOLDER = {"type": "string", "minLength": 1, "maxLength": 200}
TOKEN = {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}
TTL = {"type": "number", "exclusiveMinimum": 0, "maximum": 86400}
WINDOW = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_WINDOW_SECONDS}
ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 1}}
PAGE = [
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
    {"name": "before", "in": "query", "schema": {"type": "integer"}, "description": "keyset: ids below this"},
]
STATUSES = ["AWAITING", "BLOCKED", "READY", "RUNNING", "SUCCESSFUL", "FAILED", "CANCELLED"]
WORKFLOW_STATUSES = ["RUNNING", "SUCCESSFUL", "FAILED", "CANCELLED"]
_STAMP = {"type": ["string", "null"], "format": "date-time"}
ERROR = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {"type": "string"},
        "field": {"type": "string", "description": "the body field or query parameter refused"},
        "status": {"type": "string", "description": "409: the status of the task, workflow or bulk operation"},
        "holder": {"type": ["string", "null"], "description": "409 on a lease: who holds it now"},
        "expires_at": {**_STAMP, "description": "409 on a lease: when the current holder's lease expires"},
    },
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "required": True,
        **_json({"type": "object", "properties": properties, "required": required, "additionalProperties": False}),
    }


def _responses(ok: int | tuple[int, ...], schema: dict[str, Any], *errors: int) -> dict[str, Any]:
    """``ok`` the success status(es), each answering ``schema``; every operation may answer 400 (its
    query string is checked), 401 and 403."""
    described = {
        400: "invalid body or query (any route: a query string that cannot be stored, an unknown ?db=)",
        401: "no valid credentials",
        403: "not staff, CSRF token missing, or without the route's permission (a token: its scope)",
        404: "unknown id",
        409: "conflict: held by another holder, lease lost, or already finished",
    }
    responses: dict[str, Any] = {
        str(status): {"description": "success", **_json(schema)} for status in (ok if isinstance(ok, tuple) else (ok,))
    }
    for status in sorted({400, 401, 403, *errors}):
        responses[str(status)] = {"description": described[status], **_json(_ref("Error"))}
    return responses


def _op(summary: str, ok: int | tuple[int, ...], schema: dict[str, Any], *errors: int, **extra: Any) -> dict[str, Any]:
    return {"summary": summary, "responses": _responses(ok, schema, *errors), **extra}


def _object(properties: dict[str, Any], *optional: str, **extra: Any) -> dict[str, Any]:
    """An object the API answers: every property is in every answer, but the ``optional`` ones. The
    tests hold each answer to it and refuse a field it does not name (tests/helpers/api.py)."""
    return {
        "type": "object",
        "properties": properties,
        "required": [name for name in properties if name not in optional],
        **extra,
    }


def _list(name: str, item: dict[str, Any]) -> dict[str, Any]:
    return _object({name: {"type": "array", "items": item}, "next": NEXT})


#: Any keys (a handler's arguments, a lease's metadata, ...): said so, as an answer's objects are closed.
ANY_OBJECT = {"type": "object", "additionalProperties": True}
NEXT = {"type": ["string", "null"], "description": "the query string of the next page; null on the last"}
