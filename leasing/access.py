"""Who may do what: model permissions for staff users, scopes for bearer tokens, safe redirects.

Every route declares, per HTTP method, the Django permissions it needs: reads the model's ``view``
permission, actions its ``change`` permission (enqueueing a task: ``tasks.add_task``). A staff session
needs those permissions (a superuser has all); being staff alone lets one in, not act.

Bearer tokens (``settings.LEASING_API_TOKENS``) carry the same names as *scopes*. An entry is either a
bare token, which has every scope (the behaviour before scopes existed), or ``token:scope+scope``,
limited to those scopes; a dict ``{token: [scopes]}`` works too (``["*"]``: every scope). The scopes are
the permissions below, e.g. ``worker-7:tasks.view_task+tasks.change_task`` for an HTTP worker that
claims and finishes tasks but may not enqueue them.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.db import transaction
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import render
from django.utils.http import url_has_allowed_host_and_scheme

from leasing.bounds import without_jit
from leasing.routing import database_param, parse_database, using_database
from leasing.validation import InvalidInput, check_params

VIEW_LEASE = "leasing.view_lease"
CHANGE_LEASE = "leasing.change_lease"
VIEW_TASK = "tasks.view_task"
ADD_TASK = "tasks.add_task"
CHANGE_TASK = "tasks.change_task"
VIEW_WORKER = "tasks.view_worker"
VIEW_GENERATOR = "tasks.view_generatorstate"
CHANGE_GENERATOR = "tasks.change_generatorstate"
VIEW_SCHEDULE = "tasks.view_schedule"
ADD_SCHEDULE = "tasks.add_storedschedule"
CHANGE_SCHEDULE = "tasks.change_storedschedule"
DELETE_SCHEDULE = "tasks.delete_storedschedule"
VIEW_QUEUE = "tasks.view_queuecontrol"
CHANGE_QUEUE = "tasks.change_queuecontrol"

#: Every scope a token may carry ("*" is all of them).
SCOPES = frozenset(
    {
        VIEW_LEASE,
        CHANGE_LEASE,
        VIEW_TASK,
        ADD_TASK,
        CHANGE_TASK,
        VIEW_GENERATOR,
        CHANGE_GENERATOR,
        VIEW_SCHEDULE,
        ADD_SCHEDULE,
        CHANGE_SCHEDULE,
        DELETE_SCHEDULE,
        VIEW_QUEUE,
        CHANGE_QUEUE,
    }
)
ALL = "*"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

Permissions = tuple[str, ...]


def _scopes(token: str, scopes: Iterable[str] | None) -> frozenset[str] | None:
    names = {scope.strip() for scope in (scopes or []) if scope.strip()}
    if not names or ALL in names:
        return None
    unknown = sorted(names - SCOPES)
    if unknown:
        raise ImproperlyConfigured(
            f"LEASING_API_TOKENS: unknown scope(s) {', '.join(unknown)} for token {token[:4]}…;"
            f" known: {', '.join(sorted(SCOPES))} or {ALL}"
        )
    return frozenset(names)


def parse_tokens(entries: Any) -> dict[str, frozenset[str] | None]:
    """``LEASING_API_TOKENS`` as {token: scopes}; None means every scope."""
    pairs: list[tuple[str, list[str] | None]] = []
    if isinstance(entries, Mapping):
        pairs = [(str(token), None if scopes is None else list(scopes)) for token, scopes in entries.items()]
    else:
        for entry in entries or []:
            token, _, scopes = str(entry).strip().partition(":")
            pairs.append((token, scopes.split("+") if scopes else None))
    return {token.strip(): _scopes(token.strip(), scopes) for token, scopes in pairs if token.strip()}


def api_tokens() -> dict[str, frozenset[str] | None]:
    return parse_tokens(getattr(settings, "LEASING_API_TOKENS", None))


def match_token(offered: str, tokens: Iterable[str]) -> str | None:
    """The configured token equal to ``offered`` (compared in constant time), if any."""
    found = None
    for token in tokens:
        if hmac.compare_digest(offered.encode("utf-8", "replace"), token.encode()):
            found = token
    return found


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: a staff user, or a bearer token with its scopes (None: all)."""

    name: str
    user: Any = None
    scopes: frozenset[str] | None = None

    def has_perms(self, permissions: Iterable[str]) -> bool:
        wanted = list(permissions)
        if self.user is not None:
            return bool(self.user.has_perms(wanted))
        return self.scopes is None or all(permission in self.scopes for permission in wanted)


def declared(view: Any, permissions: Mapping[str, Iterable[str]], *, head: bool = False) -> dict[str, Permissions]:
    """Record on ``view`` what each method needs (the route table test reads it); with ``head``,
    HEAD is served as GET is."""
    table = {method.upper(): tuple(needed) for method, needed in permissions.items()}
    if head and "GET" in table:
        table.setdefault("HEAD", table["GET"])
    view.permissions = table
    return table


def staff_page(**permissions: Iterable[str]) -> Callable[[Callable[..., HttpResponse]], Callable[..., HttpResponse]]:
    """A dashboard page: staff login (else the admin login), the permissions of each method (else
    403), a sane query string and form (else a 400 page), the database of ``?db=`` (an unknown one
    is a 400 page); an unsafe method runs in one transaction there, so a page that refuses an
    action after a partial write rolls it back."""

    def decorator(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            needed = table.get(request.method or "")
            if needed is None:
                return HttpResponseNotAllowed(sorted(table))
            if not request.user.has_perms(needed):
                raise PermissionDenied(f"needs the permission(s) {', '.join(needed)}")
            try:
                check_params(request.GET)
                if request.method not in SAFE_METHODS:
                    check_params(request.POST)
                alias = parse_database(database_param(request.GET))
            except InvalidInput as exc:
                return bad_request_page(request, exc.message)
            # The database this page shows (``?db=``): named on the page, kept in its links.
            request.leasing_database = alias  # type: ignore[attr-defined]
            with using_database(alias), without_jit():
                if request.method in SAFE_METHODS:
                    return view(request, *args, **kwargs)
                with transaction.atomic(using=alias):
                    return view(request, *args, **kwargs)

        table = declared(wrapper, permissions, head=True)
        guarded = staff_member_required(wrapper)
        guarded.permissions = table  # type: ignore[attr-defined]
        return guarded

    return decorator


def bad_request_page(request: HttpRequest, reason: str) -> HttpResponse:
    return render(request, "leasing/bad_request.html", {"reason": reason}, status=400)


def safe_next(request: HttpRequest, candidate: str | None, default: str) -> str:
    """``candidate`` if it is a path on this site, else ``default``. Django's check refuses other
    hosts and schemes (``//evil.example``, ``https://evil.example``, ``/\\evil.example``); the pages'
    forms send absolute paths, so anything else (a relative ``x``) falls back too."""
    if (
        candidate
        and candidate.startswith("/")
        and url_has_allowed_host_and_scheme(
            candidate, allowed_hosts={request.get_host()}, require_https=request.is_secure()
        )
    ):
        return candidate
    return default
