"""One start/stop/join protocol for every long-running part: the maintenance rounds (recovery, the
scheduler, the demo generator) and the worker's heartbeat and listener.

A service has ``run()``, which blocks until the service ends, and ``stop()``, which any thread may
call and which makes ``run()`` return soon. :class:`Services` runs each on a thread of its own and
stops them in the reverse of the order they started: :meth:`Services.stop` asks,
:meth:`Services.join` waits."""

from __future__ import annotations

import logging
import threading
from typing import Protocol

logger = logging.getLogger("tasks.worker")


class Service(Protocol):
    def run(self) -> None: ...

    def stop(self) -> None: ...


class Services:
    def __init__(self) -> None:
        self._running: list[tuple[str, Service, threading.Thread]] = []

    def start(self, name: str, service: Service) -> None:
        thread = threading.Thread(target=service.run, name=name, daemon=True)
        thread.start()
        self._running.append((name, service, thread))

    @property
    def names(self) -> list[str]:
        """The services started (their threads are named alike)."""
        return [name for name, _service, _thread in self._running]

    def alive(self, name: str) -> bool:
        return any(n == name and thread.is_alive() for n, _service, thread in self._running)

    def stop(self) -> None:
        """Ask every service to stop, last started first (returns at once)."""
        for _name, service, _thread in reversed(self._running):
            service.stop()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for each service's thread to end."""
        for name, _service, thread in reversed(self._running):
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the %s service did not stop within %gs", name, timeout)
