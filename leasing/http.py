"""Plumbing of the JSON API: authentication, body validation, errors as JSON.

Authentication: a staff session (unsafe methods also need the CSRF token, as in any Django form),
or ``Authorization: Bearer <token>`` with a token from ``settings.LEASING_API_TOKENS`` (a list;
the demo project reads the ``LEASING_API_TOKENS`` environment variable). Nothing is readable
without one of them: 401 without credentials, 403 for a logged-in user who is not staff.

Errors are JSON: ``{"error": "...", "field": "..."}`` with 400 (invalid body), 401/403, 404
(unknown id), 405, 409 (held by another, lease lost, already finished).
"""

from __future__ import annotations

import datetime as dt
import functools
import hmac
import json
import math
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.utils.dateparse import parse_datetime
from django.views.decorators.csrf import csrf_exempt

MAX_BODY = 1_000_000  # bytes


class ApiError(Exception):
    def __init__(self, http_status: int, message: str, field: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = http_status
        self.message = message
        self.field = field
        self.extra = extra

    def response(self) -> JsonResponse:
        body: dict[str, Any] = {"error": self.message}
        if self.field:
            body["field"] = self.field
        body.update(self.extra)
        return JsonResponse(body, status=self.status)


def _bearer_tokens() -> list[str]:
    tokens = getattr(settings, "LEASING_API_TOKENS", []) or []
    return [token for token in tokens if token]


def authenticate(request: HttpRequest) -> str:
    """Who is calling ("token" or the staff username); raises ApiError 401/403."""
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer" or not credential.strip():
            raise ApiError(401, "use 'Authorization: Bearer <token>'")
        if any(hmac.compare_digest(credential.strip().encode(), t.encode()) for t in _bearer_tokens()):
            return "token"
        raise ApiError(401, "invalid bearer token")
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        raise ApiError(401, "authentication required: a staff session or a bearer token")
    if not user.is_staff:
        raise ApiError(403, "staff only")
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        # Session auth is cookie auth: unsafe methods need the CSRF token like any form post.
        rejected = CsrfViewMiddleware(lambda r: HttpResponse()).process_view(request, lambda r: HttpResponse(), (), {})
        if rejected is not None:
            raise ApiError(403, "CSRF token missing or incorrect")
    return user.get_username()


def api_view(*methods: str) -> Callable[[Callable[..., Any]], Callable[..., HttpResponse]]:
    """JSON view: method check, authentication, ApiError -> JSON response."""

    def decorator(view: Callable[..., Any]) -> Callable[..., HttpResponse]:
        @csrf_exempt  # checked in authenticate() for session requests; bearer requests carry no cookie
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                if request.method not in methods:
                    raise ApiError(405, f"method {request.method} not allowed; use {', '.join(methods)}")
                request.api_caller = authenticate(request)  # type: ignore[attr-defined]
                result = view(request, *args, **kwargs)
            except ApiError as error:
                response = error.response()
                if error.status == 405:
                    response["Allow"] = ", ".join(methods)
                return response
            if isinstance(result, HttpResponse):
                return result
            status, body = result
            return JsonResponse(body, status=status, safe=False)

        return wrapper

    return decorator


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_storable(value: Any, depth: int = 0) -> None:
    """PostgreSQL cannot store NUL characters in text or jsonb: refuse them here, as a 400."""
    if depth > 64:
        raise ApiError(400, "body is nested too deeply")
    if isinstance(value, str):
        if "\x00" in value:
            raise ApiError(400, "strings must not contain NUL characters")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_storable(key, depth + 1)
            _check_storable(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_storable(item, depth + 1)


class Body:
    """A validated JSON object body; every accessor raises ApiError(400) with the field name."""

    def __init__(self, request: HttpRequest, *, required: bool = True) -> None:
        raw = request.body
        if len(raw) > MAX_BODY:
            raise ApiError(400, f"body larger than {MAX_BODY} bytes")
        if not raw.strip():
            if required:
                raise ApiError(400, "a JSON object body is required")
            self.data: dict[str, Any] = {}
            return
        try:
            data = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body must be a JSON object")
        _check_storable(data)
        self.data = data

    def _get(self, name: str, required: bool) -> Any:
        if name not in self.data or self.data[name] is None:
            if required:
                raise ApiError(400, f"{name} is required", name)
            return None
        return self.data[name]

    def text(self, name: str, *, required: bool = True, max_length: int = 255, default: str | None = None) -> Any:
        value = self._get(name, required)
        if value is None:
            return default
        if not isinstance(value, str) or not value.strip():
            raise ApiError(400, f"{name} must be a non-empty string", name)
        if len(value) > max_length or "\x00" in value:
            raise ApiError(400, f"{name} must be at most {max_length} characters, without NUL", name)
        return value

    def whole(self, name: str, *, required: bool = True, low: int, high: int, default: int | None = None) -> Any:
        value = self._get(name, required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ApiError(400, f"{name} must be a whole number from {low} to {high}", name)
        return value

    def number(self, name: str, *, required: bool = True, low: float, high: float, default: float | None = None) -> Any:
        value = self._get(name, required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ApiError(400, f"{name} must be a number", name)
        if not low < value <= high:
            raise ApiError(400, f"{name} must be greater than {low:g} and at most {high:g}", name)
        return float(value)

    def flag(self, name: str, *, default: bool) -> bool:
        value = self._get(name, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ApiError(400, f"{name} must be true or false", name)
        return value

    def mapping(self, name: str, *, required: bool = False) -> Any:
        value = self._get(name, required)
        if value is not None and not isinstance(value, dict):
            raise ApiError(400, f"{name} must be a JSON object", name)
        return value

    def array(self, name: str, *, required: bool = False) -> Any:
        value = self._get(name, required)
        if value is not None and not isinstance(value, list):
            raise ApiError(400, f"{name} must be a JSON array", name)
        return value

    def names(self, name: str, *, default: list[str]) -> list[str]:
        value = self.array(name)
        if value is None:
            return default
        if not value or len(value) > 50 or not all(isinstance(v, str) and 0 < len(v) <= 100 for v in value):
            raise ApiError(400, f"{name} must be a list of 1 to 50 names", name)
        return value

    def when(self, name: str) -> dt.datetime | None:
        value = self._get(name, False)
        if value is None:
            return None
        parsed = parse_datetime(value) if isinstance(value, str) else None
        if parsed is None or parsed.tzinfo is None:
            raise ApiError(400, f"{name} must be an ISO 8601 date-time with a time zone", name)
        return parsed

    def only(self, *allowed: str) -> None:
        unknown = sorted(set(self.data) - set(allowed))
        if unknown:
            raise ApiError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])


def iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def page_args(request: HttpRequest, *, default_limit: int = 50, max_limit: int = 500) -> tuple[int, int | None]:
    """``?limit=&before=`` for keyset pagination by descending id."""
    try:
        limit = int(request.GET.get("limit", default_limit))
        before = request.GET.get("before")
        before_id = int(before) if before not in (None, "") else None
    except ValueError:
        raise ApiError(400, "limit and before must be whole numbers") from None
    if not 1 <= limit <= max_limit:
        raise ApiError(400, f"limit must be from 1 to {max_limit}", "limit")
    return limit, before_id


def keyset_page(
    request: HttpRequest, queryset: Any, key: str, serialize: Callable[[Any], dict[str, Any]]
) -> tuple[int, dict[str, Any]]:
    """One page, newest first, continued by ``?before=<last id>`` (no OFFSET, no COUNT)."""
    limit, before = page_args(request)
    if before is not None:
        queryset = queryset.filter(pk__lt=before)
    rows = list(queryset.order_by("-pk")[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return 200, {
        key: [serialize(row) for row in rows],
        "next": f"?limit={limit}&before={rows[-1].pk}" if more else None,
    }
