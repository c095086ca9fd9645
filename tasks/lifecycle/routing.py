"""Which database holds a queue: ``LEASING_TASKS["QUEUE_DATABASES"]`` (see leasing/routing.py).

:func:`queue_database` is the one lookup; enqueue, the API, the django.tasks backend, the worker
and the scheduler all ask it. A task id is unique within its database only: pages and the API
name the database with ``?db=`` (default: ``default``).
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import DEFAULT_DB_ALIAS

from leasing.routing import check_routes
from tasks.conf import derived, get_settings


def queue_routes() -> dict[str, str]:
    """The routes, checked once per settings (the returned dict is shared: do not change it)."""
    return derived("queue_routes", _check_routes)


def _check_routes() -> dict[str, str]:
    return check_routes(get_settings().QUEUE_DATABASES, 'LEASING_TASKS["QUEUE_DATABASES"]')


def queue_database(queue: str) -> str:
    """The alias holding ``queue`` (``default`` unless routed)."""
    return queue_routes().get(queue, DEFAULT_DB_ALIAS)


def queues_by_database(queues: Iterable[str]) -> dict[str, list[str]]:
    """``queues`` grouped by the alias holding each, in the order first seen."""
    grouped: dict[str, list[str]] = {}
    routes = queue_routes()
    for queue in queues:
        grouped.setdefault(routes.get(queue, DEFAULT_DB_ALIAS), []).append(queue)
    return grouped
