from __future__ import annotations

import getpass
import os
import socket
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from leasing.routing import known_databases
from tasks.backends.placement import misrouted
from tasks.exceptions import TaskError
from tasks.lifecycle.routing import queue_database
from tasks.lifecycle.values import validate_enqueue
from tasks.models import QueueControl
from tasks.web.queues import queue_overview

IDLE = {"paused": False, "waiting": 0, "waiting_capped": False, "blocked": 0, "blocked_capped": False, "running": 0}


class Command(BaseCommand):
    help = (
        "Pause, resume or show a queue. A paused queue is claimed by no worker or client (from their next "
        "claim); running tasks finish; enqueueing into it still works. The switch is written in the database "
        "the queue's workers claim from (LEASING_TASKS['QUEUE_DATABASES'], or --database)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["pause", "resume", "status"])
        parser.add_argument("name", nargs="?", help="the queue (status without a name lists every known queue)")
        parser.add_argument("--reason", default="", help="why (shown on the dashboard)")
        parser.add_argument(
            "--database",
            help="the database alias whose workers should obey (a queue taken by a LeaseBackend pinned to "
            "another database than its route); default: the queue's route. status: the databases to show "
            "(default: every database holding our tables)",
        )

    def handle(self, *, action: str, name: str | None, reason: str, database: str | None, **options: Any) -> None:
        if action != "status" and not name:
            raise CommandError(f"{action} needs a queue name")
        if database is not None and database not in known_databases():
            raise CommandError(f"unknown database {database!r}; known: {', '.join(known_databases())}")
        if name is not None:
            try:
                validate_enqueue(queue=name, priority=0, max_attempts=1, timeout=None)
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            if database is not None and misrouted([name], database):
                raise CommandError(
                    f"no task of queue {name!r} lands in database {database!r} (it is routed to "
                    f"{queue_database(name)!r}): a switch there would pause nobody"
                )
        by = f"{getpass.getuser()}@{socket.gethostname()}:{os.getpid()} (manage.py tasks_queue)"
        try:
            if action in ("pause", "resume"):
                assert name is not None
                # --database was checked above to be one where the queue's tasks land.
                controls = QueueControl.objects.db_manager(database or queue_database(name))
                if action == "pause":
                    controls.pause(name, by=by, reason=reason)
                else:
                    controls.resume(name, by=by)
        except (TaskError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        if name is not None:
            aliases = [database or queue_database(name)]
        else:
            aliases = [database] if database else known_databases()
        for alias in aliases:
            # The same bounded reads as the dashboard's queue page: a loose index scan for the queues,
            # counts that stop at 10,000 (shown "10000+").
            entries = [e for e in queue_overview(alias) if name is None or e["name"] == name]
            if name is not None and not entries:  # no task and no switch: an idle, running queue
                entries = [{**IDLE, "name": name}]
            for entry in entries:
                self.stdout.write(self._line(entry, alias if len(aliases) > 1 or alias != "default" else None))

    @staticmethod
    def _line(entry: dict[str, Any], alias: str | None) -> str:
        waiting = f"{entry['waiting']}{'+' if entry['waiting_capped'] else ''}"
        line = f"{entry['name']}: {'paused' if entry['paused'] else 'running'}, {waiting} waiting"
        if entry["blocked"]:
            line += f" ({entry['blocked']}{'+' if entry['blocked_capped'] else ''} more waiting for a concurrency slot)"
        line += f", {entry['running']} running"
        if entry["paused"]:
            line += f" (since {entry['changed_at']:%Y-%m-%d %H:%M:%S %Z} by {entry['changed_by'] or 'unknown'}"
            line += f": {entry['reason']})" if entry["reason"] else ")"
        if alias is not None:
            line += f" [database {alias}]"
        return line
