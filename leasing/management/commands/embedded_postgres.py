from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from leasing import embedded


class Command(BaseCommand):
    help = (
        "The embedded PostgreSQL these settings start when DATABASE_URL is unset (leasing.embedded.database_url): "
        "whether it runs, or stop it. It outlives the commands that start it; this one starts nothing, and the "
        "next other command starts it again on the same data."
    )
    # The server may be stopped: nothing here connects to a database.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["status", "stop"])

    def handle(self, *, action: str, **options: Any) -> None:
        server = embedded.server_in_use()
        if server is None:
            raise CommandError(
                "these settings use no embedded PostgreSQL: DATABASE_URL is set, or DATABASES does not call "
                "leasing.embedded.database_url; that database is not this project's to stop"
            )
        pid = server.pid
        where = f"data directory {server.pgdata}, socket {server.socket_path}"
        if action == "status":
            if pid is not None:
                self.stdout.write(f"embedded PostgreSQL running (pid {pid}): {where}")
            elif (server.pgdata / "PG_VERSION").exists():
                self.stdout.write(f"embedded PostgreSQL stopped: {where}; the next manage.py command starts it")
            else:
                self.stdout.write(f"no embedded PostgreSQL in {server.pgdata} yet: the next manage.py command makes it")
            return
        if pid is None:
            self.stdout.write(f"embedded PostgreSQL not running: {where}")
            return
        # "fast": the sessions connected to it (workers, runserver) are ended and their transactions rolled back.
        server.stop("fast")
        self.stdout.write(self.style.SUCCESS(f"embedded PostgreSQL stopped (was pid {pid}): {where}"))
