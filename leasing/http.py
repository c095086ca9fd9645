"""Plumbing of the JSON API: authentication, permissions, validation, one transaction, errors as JSON.

Authentication: a staff session (unsafe methods also need the CSRF token, as in any Django form),
or ``Authorization: Bearer <token>`` with a token from ``settings.LEASING_API_TOKENS`` (a list;
the demo project reads the ``LEASING_API_TOKENS`` environment variable). Nothing is readable
without one of them: 401 without credentials, 403 for a logged-in user who is not staff, and 403
for a staff user without the route's permission or a token without its scope (see
:mod:`leasing.access`).

Every body, query string and id is checked at the edge (:mod:`leasing.validation`), and every
request that may write runs in one transaction: a request answered with an error changes nothing.

A task or lease id is unique within its database only: ``?db=alias`` selects the database a
request reads and acts on (default: ``default``; an alias that holds none of our tables is a 400);
creating a task or a lease goes to the database its queue or namespace is routed to, and a ``?db=``
naming another is a 400 (:func:`routed`). See leasing/routing.py.

Errors are JSON: ``{"error": "...", "field": "..."}`` with 400 (invalid body or query), 401/403, 404
(unknown id), 405, 409 (held by another, lease lost, already finished).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DataError, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.views.decorators.csrf import csrf_exempt

from leasing.access import SAFE_METHODS, Caller, api_tokens, declared, match_token
from leasing.bounds import without_jit
from leasing.routing import database_param, parse_database, using_database
from leasing.validation import (
    MAX_BIGINT,
    InvalidInput,
    check_params,
    clean_text,
    loads,
    parse_when,
    parse_whole,
)

MAX_BODY = 1_000_000  # bytes

logger = logging.getLogger("leasing.api")


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


def authenticate(request: HttpRequest) -> Caller:
    """Who is calling: a token (with its scopes) or a staff user; raises ApiError 401/403."""
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer" or not credential.strip():
            raise ApiError(401, "use 'Authorization: Bearer <token>'")
        tokens = api_tokens()
        token = match_token(credential.strip(), tokens)
        if token is not None:
            return Caller("token", scopes=tokens[token])
        raise ApiError(401, "invalid bearer token")
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        raise ApiError(401, "authentication required: a staff session or a bearer token")
    if not user.is_active or not user.is_staff:
        raise ApiError(403, "staff only")
    if request.method not in SAFE_METHODS:
        # Session auth is cookie auth: unsafe methods need the CSRF token like any form post.
        rejected = CsrfViewMiddleware(lambda r: HttpResponse()).process_view(request, lambda r: HttpResponse(), (), {})
        if rejected is not None:
            raise ApiError(403, "CSRF token missing or incorrect")
    return Caller(user.get_username(), user=user)


def api_view(**permissions: Iterable[str]) -> Callable[[Callable[..., Any]], Callable[..., HttpResponse]]:
    """JSON view: ``api_view(GET=(VIEW_TASK,), POST=(ADD_TASK,))`` names the methods it serves and
    the permission (or token scope) each needs. It checks the method, the caller, the permission and
    the query string, runs an unsafe method in one transaction (rolled back on any error, so a
    rejected request changes nothing) and turns ApiError into a JSON response."""

    def decorator(view: Callable[..., Any]) -> Callable[..., HttpResponse]:
        @csrf_exempt  # checked in authenticate() for session requests; bearer requests carry no cookie
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            alias = DEFAULT_DB_ALIAS
            try:
                needed = table.get(request.method or "")
                if needed is None:
                    raise ApiError(405, f"method {request.method} not allowed; use {', '.join(methods)}")
                caller = authenticate(request)
                if not caller.has_perms(needed):
                    what = "the token lacks the scope(s)" if caller.user is None else "you lack the permission(s)"
                    raise ApiError(403, f"{what} {', '.join(needed)}")
                request.api_caller = caller  # type: ignore[attr-defined]
                check_params(request.GET)
                alias = parse_database(database_param(request.GET))
                with using_database(alias), without_jit():
                    if request.method in SAFE_METHODS:
                        result = view(request, *args, **kwargs)
                    else:
                        with transaction.atomic(using=alias):
                            result = view(request, *args, **kwargs)
            except InvalidInput as invalid:
                return ApiError(400, invalid.message, invalid.field).response()
            except ApiError as error:
                response = error.response()
                if error.status == 405:
                    response["Allow"] = ", ".join(methods)
                return response
            except DataError as exc:
                # The checks above should leave nothing for the database to refuse; if it still does,
                # the value came from the request, the transaction is rolled back, and it is a 400.
                logger.warning("database refused a value from %s %s: %s", request.method, request.path, exc)
                if request.method in SAFE_METHODS and transaction.get_connection(alias).in_atomic_block:
                    # A read has no block of its own: the caller's (ATOMIC_REQUESTS) is broken now.
                    transaction.set_rollback(True, using=alias)
                return ApiError(400, f"the database refused a value: {str(exc).splitlines()[0][:200]}").response()
            if isinstance(result, HttpResponse):
                return result
            status, body = result
            return JsonResponse(body, status=status, safe=False)

        table = declared(wrapper, permissions)
        methods = list(table)
        return wrapper

    return decorator


@contextmanager
def routed(request: HttpRequest, alias: str, what: str) -> Iterator[str]:
    """Run a create in ``alias``, the database ``what`` is routed to: 400 when ``?db=`` names
    another (the request would otherwise write where it did not ask to), in one transaction there."""
    asked = database_param(request.GET)
    if asked not in (None, "") and asked != alias:
        raise ApiError(400, f"db: {what} is routed to database {alias!r}, not {asked!r}", "db")
    with using_database(alias), transaction.atomic(using=alias):
        yield alias


class Body:
    """A validated JSON object body; every accessor raises ApiError(400) with the field name.

    The whole document is checked as it is parsed (:func:`leasing.validation.loads`): finite numbers
    of bounded length, no NUL and no lone surrogate in any string or key, bounded depth."""

    def __init__(self, request: HttpRequest, *, required: bool = True) -> None:
        raw = request.body
        if len(raw) > MAX_BODY:
            raise ApiError(400, f"body larger than {MAX_BODY} bytes")
        if not raw.strip():
            if required:
                raise ApiError(400, "a JSON object body is required")
            self.data: dict[str, Any] = {}
            return
        data = loads(raw)
        if not isinstance(data, dict):
            raise ApiError(400, "body must be a JSON object")
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
        return clean_text(value, name, max_length=max_length)

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
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ApiError(400, f"{name} must be a number", name)
        if not low < value <= high:  # finite: the parser refuses NaN and infinities
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
        return parse_when(value, name)

    def only(self, *allowed: str) -> None:
        unknown = sorted(set(self.data) - set(allowed))
        if unknown:
            raise ApiError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])


def iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def query_text(request: HttpRequest, name: str, *, max_length: int = 255) -> str | None:
    """A query-string filter (None when absent or empty); storable text of bounded length."""
    value = request.GET.get(name)
    if value in (None, ""):
        return None
    return clean_text(value, name, max_length=max_length)


def query_id(request: HttpRequest, name: str) -> int | None:
    """A query-string id or token: ASCII digits, 1 to 2**63 - 1 (None when absent or empty)."""
    value = request.GET.get(name)
    if value in (None, ""):
        return None
    return parse_whole(value, name, low=1, high=MAX_BIGINT)


def page_args(request: HttpRequest, *, default_limit: int = 50, max_limit: int = 500) -> tuple[int, int | None]:
    """``?limit=&before=`` for keyset pagination by descending id."""
    limit_text = request.GET.get("limit")
    limit = default_limit if limit_text in (None, "") else parse_whole(limit_text, "limit", low=1, high=max_limit)
    return limit, query_id(request, "before")


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
