"""Which database holds what: lease namespaces and task queues routed to database aliases.

Two settings, one rule each, read on every call (``override_settings`` works in tests):

- ``LEASING["DATABASES"] = {"billing:": "billing"}``: a lease whose resource starts with a prefix
  lives in that alias (the longest matching prefix wins; no match: ``default``). Used by ``lease()``,
  :class:`~leasing.election.LeaderElection` and the Celery guard whenever no ``using=`` is given.
- ``LEASING_TASKS["QUEUE_DATABASES"] = {"reports": "analytics"}``: a task queue lives in that alias
  (exact queue names; others: ``default``). Used by ``Task.objects.enqueue`` / ``bulk_enqueue``
  without an explicit database, the JSON API, the django.tasks backend (without an explicit
  ``OPTIONS["database"]``), the worker and the scheduler (:func:`tasks.lifecycle.routing.queue_database`).

Settings rather than a Django database router: the decision depends on a name the caller passes
(a queue, a resource), not on the model, and every consumer here needs the same answer before any
query runs (the worker to refuse a queue, the scheduler to pick its schedules, a scrape to list
the databases); a router's ``db_for_write(model, **hints)`` would need that name smuggled in as a
hint at every call site, and a project's own routers would then have to agree with ours.

Pages and the API read one database per request: ``?db=alias`` selects it
(:func:`parse_database`), and :func:`using_database` makes it the one the models' default managers
query for the duration of the request (a context variable: no other thread or request sees it).

Fencing tokens come from one sequence *per database*: see docs/explanation/fault-model.md, "Several databases".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections, models

from leasing.validation import InvalidInput, check_text

_selected: ContextVar[str | None] = ContextVar("leasing_selected_database", default=None)

#: Callables naming further aliases that hold our tables (the task app adds its queue routes and
#: its backends' databases), so that pages, the API and metrics know every database to offer.
DATABASE_SOURCES: list[Callable[[], Iterable[str]]] = []


def check_routes(routes: Any, setting: str) -> dict[str, str]:
    """``routes`` as {name: alias}; raises ImproperlyConfigured naming ``setting`` on anything else."""
    if routes is None:
        return {}
    if not isinstance(routes, Mapping):
        raise ImproperlyConfigured(f"{setting} must be a dict of name -> database alias, not {type(routes).__name__}")
    for name, alias in routes.items():
        if not isinstance(name, str) or not name:
            raise ImproperlyConfigured(f"{setting}: keys must be non-empty strings, not {name!r}")
        if not isinstance(alias, str) or alias not in connections.settings:
            known = ", ".join(sorted(connections.settings))
            raise ImproperlyConfigured(f"{setting}[{name!r}]: no database {alias!r} in DATABASES (known: {known})")
    return dict(routes)


def lease_routes() -> dict[str, str]:
    from leasing.conf import get_settings

    return check_routes(get_settings().DATABASES, 'LEASING["DATABASES"]')


def lease_database(resource: str) -> str:
    """The alias holding the lease on ``resource``: the longest matching namespace prefix."""
    best = ""
    alias = DEFAULT_DB_ALIAS
    for prefix, target in lease_routes().items():
        if len(prefix) > len(best) and resource.startswith(prefix):
            best, alias = prefix, target
    return alias


def known_databases() -> list[str]:
    """Aliases that hold our tables, ``default`` first: the ones routes and backends name."""
    aliases = [DEFAULT_DB_ALIAS, *lease_routes().values()]
    for source in DATABASE_SOURCES:
        aliases.extend(source())
    return list(dict.fromkeys(alias for alias in aliases if alias in connections.settings))


def parse_database(value: str | None, name: str = "db") -> str:
    """A ``?db=`` value: one of :func:`known_databases` (absent or empty: ``default``).

    Raises :class:`~leasing.validation.InvalidInput` (a 400) for anything else, without echoing a
    long or unprintable value back."""
    if value in (None, ""):
        return DEFAULT_DB_ALIAS
    assert value is not None
    check_text(value, name)
    known = known_databases()
    if value not in known:
        shown = repr(value) if len(value) <= 100 else f"{value[:100]!r}..."
        raise InvalidInput(f"{name}: unknown database {shown}; known: {', '.join(known)}", name)
    return value


def database_param(query: Any, name: str = "db") -> str | None:
    """The one ``?db=`` value of a query string (a QueryDict), or None when absent.

    Raises :class:`~leasing.validation.InvalidInput` when it is given more than once: which one a
    request means is ambiguous (a link that appended ``db`` to a URL already carrying one), and
    picking either could act on a database the caller did not mean."""
    values = query.getlist(name) if hasattr(query, "getlist") else [query.get(name)]
    if len(values) > 1:
        raise InvalidInput(f"{name}: given {len(values)} times; name one database", name)
    return values[0] if values else None


def selected_database() -> str:
    """The alias this request reads (``?db=``), else ``default``."""
    return _selected.get() or DEFAULT_DB_ALIAS


@contextmanager
def using_database(alias: str) -> Iterator[str]:
    """Within the block, the default managers of our models query ``alias`` (this context only)."""
    token = _selected.set(alias)
    try:
        yield alias
    finally:
        _selected.reset(token)


class SelectedManager(models.Manager[Any]):
    """A manager whose querysets read the selected database when one is selected (a request's
    ``?db=``) and the manager was not bound to one already (``db_manager(alias)`` wins)."""

    def get_queryset(self) -> models.QuerySet[Any]:
        queryset = super().get_queryset()
        alias = _selected.get()
        if alias is not None and self._db is None:
            queryset = queryset.using(alias)
        return queryset


def with_database(path: str) -> str:
    """``path`` with the selected database kept in its query string (a redirect after a form)."""
    query = database_query(selected_database())
    return f"{path}{'&' if '?' in path else '?'}{query}" if query else path


def database_query(alias: str) -> str:
    """The query string that keeps ``alias`` selected on a link: ``""`` for ``default``."""
    from urllib.parse import urlencode

    return "" if alias == DEFAULT_DB_ALIAS else urlencode({"db": alias})
