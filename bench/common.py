"""Shared set-up for the benchmarks: a database (DATABASE_URL, or an embedded server), Django."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def prepare_database() -> Any:
    """Point DATABASE_URL at a migrated database; returns the embedded server to stop, if any."""
    server = None
    if "DATABASE_URL" not in os.environ:
        from leasing.embedded import ensure_server

        # Default durability settings (fsync on): the figures are what a real deployment sees.
        server = ensure_server(Path(tempfile.mkdtemp(prefix="leasing-bench-")) / "pgdata")
        os.environ["DATABASE_URL"] = server.url()
        # The callers discard the server in a `finally`; make SIGTERM run it too.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))
    setup_django()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return server


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()


def psycopg_params() -> dict[str, Any]:
    """Connection parameters of Django's default database, for raw psycopg connections."""
    from django.db import connection

    params = connection.get_connection_params()
    return {k: v for k, v in params.items() if k in {"host", "port", "user", "password", "dbname"} and v}


def stop_processes(procs: list[Any], timeout: float = 30) -> None:
    """SIGCONT (a frozen one) + SIGTERM every process, then SIGKILL what is left after ``timeout``."""
    import subprocess

    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def figure(name: str, value: float, unit: str) -> None:
    """One comparable figure per line."""
    print(f"{name:<48} {value:>12.1f} {unit}", flush=True)
