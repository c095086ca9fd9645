"""Where a queue's tasks land once backends are counted: a ``LeaseBackend`` pinned to a database
(``OPTIONS["database"]``) takes its queues there whatever the routes say. The routes alone are
``tasks.lifecycle.routing``; this module asks django.tasks for its backends, so it sits above it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import DEFAULT_DB_ALIAS

from tasks.lifecycle.routing import queue_database, queue_routes


def misrouted(queues: Sequence[str], using: str) -> dict[str, str]:
    """The queues among ``queues`` whose tasks never land in ``using``: queue -> its alias.

    A queue lands in ``using`` when it is routed there, or when a LeaseBackend whose explicit
    ``OPTIONS["database"]`` is ``using`` takes it (its QUEUES lists it, or allows any name)."""
    routes = queue_routes()
    taken = [b.queues for b in _lease_backends() if b.explicit_database and b.using == using]
    return {
        queue: routes.get(queue, DEFAULT_DB_ALIAS)
        for queue in queues
        if routes.get(queue, DEFAULT_DB_ALIAS) != using and not any(not q or queue in q for q in taken)
    }


def switch_database(queue: str, shown: str) -> str:
    """Where a page showing database ``shown`` pauses or resumes ``queue``: ``shown`` when the queue's
    tasks land there (routed there, or taken by a LeaseBackend pinned there, whose workers claim
    there), else the database the queue is routed to. A switch is read only by the claims of its own
    database, so one written anywhere else pauses nobody."""
    return shown if not misrouted([queue], shown) else queue_database(queue)


def _lease_backends() -> list[Any]:
    from tasks.backends.backend import LeaseBackend
    from tasks.compat import InvalidTaskBackend, task_backends

    try:
        backends = task_backends.all()
    except InvalidTaskBackend:  # reported by Django's own checks; the routes still stand
        return []
    return [b for b in backends if isinstance(b, LeaseBackend)]


def routed_databases() -> list[str]:
    """Aliases that queues are routed to, and the databases of LeaseBackends (for pages, metrics)."""
    aliases = list(queue_routes().values())
    aliases.extend(b.using for b in _lease_backends() if b.explicit_database)
    return aliases
