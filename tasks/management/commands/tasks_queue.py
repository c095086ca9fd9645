from __future__ import annotations

import getpass
import os
import socket
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count, Min

from tasks.exceptions import TaskError
from tasks.models import QueueControl, Task


class Command(BaseCommand):
    help = (
        "Pause, resume or show a queue. A paused queue is claimed by no worker or client (from their next "
        "claim); running tasks finish; enqueueing into it still works."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["pause", "resume", "status"])
        parser.add_argument("name", nargs="?", help="the queue (status without a name lists every known queue)")
        parser.add_argument("--reason", default="", help="why (shown on the dashboard)")

    def handle(self, *, action: str, name: str | None, reason: str, **options: Any) -> None:
        if action != "status" and not name:
            raise CommandError(f"{action} needs a queue name")
        by = f"{getpass.getuser()}@{socket.gethostname()}:{os.getpid()} (manage.py tasks_queue)"
        try:
            if action == "pause":
                assert name is not None
                QueueControl.objects.pause(name, by=by, reason=reason)
            elif action == "resume":
                assert name is not None
                QueueControl.objects.resume(name, by=by)
        except (TaskError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        names = [name] if name else sorted({*QueueControl.objects.values_list("name", flat=True), *self._busy()})
        for queue in names:
            self.stdout.write(self._status(queue))

    @staticmethod
    def _busy() -> set[str]:
        """Queues with unfinished tasks (read from the claim and running indexes' rows only)."""
        return set(Task.objects.filter(status__in=["READY", "RUNNING"]).values_list("queue", flat=True).distinct())

    def _status(self, name: str) -> str:
        control = QueueControl.objects.filter(name=name).first()
        waiting = Task.objects.filter(queue=name, status="READY").aggregate(n=Count("id"), oldest=Min("run_after"))
        running = Task.objects.filter(queue=name, status="RUNNING").count()
        state = "paused" if control and control.paused else "running"
        line = f"{name}: {state}, {waiting['n']} waiting, {running} running"
        if control and control.paused:
            line += f" (since {control.changed_at:%Y-%m-%d %H:%M:%S %Z} by {control.changed_by or 'unknown'}"
            line += f": {control.reason})" if control.reason else ")"
        return line
