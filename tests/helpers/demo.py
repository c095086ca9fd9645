"""``manage.py demo`` as a user starts it, on the test database, and what it has shown so far.

Shared by the test that the demo shows every feature (tests/concurrency/test_demo_features.py) and the
browser's walk of the running demo (tests/e2e/test_demo_walk.py); ``Seen`` is bench/demo_health.py's,
which also times it.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.demo_health import Seen
from tests.helpers import start_manage, stop_process

__all__ = ["RunningDemo", "Seen", "free_port", "running_demo"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class RunningDemo:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@contextmanager
def running_demo(directory: Path) -> Iterator[RunningDemo]:
    """The demo's processes (web server, workers, generators, recovery) on a free port; stopped on
    the way out, its children with it."""
    port = free_port()
    log = directory / "demo.log"
    proc = start_manage(log, "demo", "--port", str(port))
    try:
        yield RunningDemo(proc, f"http://127.0.0.1:{port}", log)
    finally:
        stop_process(proc)
