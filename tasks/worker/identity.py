"""Who a worker is: a name an operator gives (``--worker-id``), the id of one process's lifetime under
that name (the holder of its leases), and its row in ``tasks_worker`` (registered at start, stopped
at the end)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
import socket
from collections.abc import Sequence

from django.db import DatabaseError
from django.db.models.functions import Now

from tasks.models import Worker as WorkerRow
from tasks.worker.session import Session

logger = logging.getLogger("tasks.worker")

#: Characters of a worker's name (``--worker-id``); its id adds ``:`` and 8 hex digits (column: 200).
NAME_MAX = 190


def default_worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def check_worker_name(name: str) -> str:
    """A name a worker can register under: printable text (PostgreSQL text refuses NUL), 1 to
    :data:`NAME_MAX` characters. Raises ValueError saying which rule it breaks."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("a worker name must be a non-empty string")
    if len(name) > NAME_MAX:
        raise ValueError(f"a worker name has at most {NAME_MAX} characters (got {len(name)})")
    if not name.isprintable():
        raise ValueError("a worker name must be printable text (no control characters)")
    return name


def incarnation_id(name: str) -> str:
    """The id a worker process holds leases under: its name and a suffix drawn anew at each start.

    A name is what an operator gives (``--worker-id``) and reuses: a StatefulSet pod, a systemd
    template instance, a restart while the previous process still drains. An id is one process's
    lifetime. Every lease, heartbeat, reconcile and stop record is keyed by the id, so one process's
    stop, death or recovery never touches the leases of another that has the same name."""
    return f"{check_worker_name(name)}:{secrets.token_hex(4)}"


def default_worker_id() -> str:
    return incarnation_id(default_worker_name())


def register(session: Session, *, queues: Sequence[str], concurrency: int) -> None:
    rows = WorkerRow.objects.using(session.using)
    horizon = Now() - dt.timedelta(seconds=2 * session.ttl)
    namesakes = list(
        rows.filter(name=session.name, stopped_at__isnull=True, last_seen_at__gte=horizon)
        .exclude(pk=session.id)
        .values_list("id", "hostname", "pid")
    )
    if namesakes:
        # Safe (each holds its own leases), and expected while a predecessor drains; two replicas
        # configured with one name for good is usually a mistake worth a line in the log.
        logger.warning(
            "worker %s: %d other live worker(s) named %r: %s; each keeps its own leases",
            session.id,
            len(namesakes),
            session.name,
            ", ".join(f"{i} (pid {p} on {h})" for i, h, p in namesakes),
        )
    rows.update_or_create(
        id=session.id,
        defaults={
            "name": session.name,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "queues": list(queues),
            "concurrency": concurrency,
            "ttl": session.ttl,
            "started_at": Now(),  # run() again on this object: a new start (crash attribution)
            "stopped_at": None,
            "stop_reason": "",
        },
    )


def record_stop(session: Session) -> None:
    """The worker's row says it stopped (and its last counters); a failure is logged, not raised."""
    try:
        WorkerRow.objects.using(session.using).filter(id=session.id).update(
            stopped_at=Now(), last_seen_at=Now(), running=0, stats=session.stats, stop_reason="stopped"
        )
    except DatabaseError as exc:
        logger.warning("worker %s: could not record its stop: %s", session.id, exc)
    logger.info("worker %s stopped: %s", session.id, json.dumps(session.stats), extra={"worker_id": session.id})
