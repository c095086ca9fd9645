"""Races played with real connections: work on a thread (hence a connection) of its own, and what
PostgreSQL shows of it (a backend waiting for a lock), to synchronise on instead of sleeping."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connection, connections


class OnItsOwnConnection(threading.Thread):
    """``work()`` on a thread, hence on a connection of its own; its backend pid (``ready`` is set once
    it is known), result or error kept."""

    def __init__(self, work: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.work = work
        self.pid: int | None = None
        self.ready = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                self.pid = cursor.fetchone()[0]
            self.ready.set()
            self.result = self.work()
        except BaseException as exc:  # handed to the test, which raises it
            self.error = exc
        finally:
            self.ready.set()
            connections.close_all()

    def outcome(self, timeout: float = 60.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "the thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def waits_for_a_lock(pid: int | None) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row and row[0])
