"""``manage.py demo`` as a user starts it, on the test database, and what it has shown so far.

Shared by the test that the demo shows every feature in time (tests/concurrency/test_demo_features.py)
and the browser's walk of the running demo (tests/e2e/test_demo_walk.py).
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks.demo import showcase
from tasks.models import Task, Workflow
from tasks.web.history import history
from tasks.web.queries import STATES
from tests.helpers import start_manage, stop_process


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


class Seen:
    """What polls of the demo's rows have observed so far: each state and view the dashboard lists,
    and each showcase feature's mark."""

    def __init__(self) -> None:
        self.marks: dict[str, bool] = {}

    def poll(self) -> bool:
        marks = self.marks
        # Each state and view the dashboard lists, read as it reads them (tasks.web.queries.STATES):
        # shown if a poll saw a task in it. Stuck (an expired lease not yet recovered) is not a goal.
        for view, state in STATES.items():
            if view != "stuck" and not marks.get(view):
                marks[view] = state.queryset().exists()
        marks["retried to success"] = Task.objects.filter(
            status="SUCCESSFUL", task_path=f"{showcase.HANDLERS}.sync_partner", failures__gt=0
        ).exists()
        marks["failed for good"] = Task.objects.filter(
            status="FAILED", task_path=f"{showcase.HANDLERS}.charge_card", failures=2
        ).exists()
        marks["workflow callback"] = Task.objects.filter(
            task_path=f"{showcase.HANDLERS}.publish_album",
            status="SUCCESSFUL",
            workflow_id__in=Workflow.objects.filter(kind="group", status="SUCCESSFUL").values("id"),
        ).exists()
        marks["chain"] = Workflow.objects.filter(kind="chain", status="SUCCESSFUL").exists()
        marks["schedule fired"] = Task.objects.filter(
            task_path=f"{showcase.HANDLERS}.nightly_digest", status="SUCCESSFUL"
        ).exists()
        marks["rate-key refusal"] = Task.objects.filter(rate_key=showcase.RATE_KEY, rate_refusals__gt=0).exists()
        fair_keys = set(
            Task.objects.filter(queue=showcase.FAIR_QUEUE, status="SUCCESSFUL")
            .values_list("fair_key", flat=True)
            .distinct()
        )
        marks["two fair keys served"] = showcase.NOISY_TENANT in fair_keys and len(fair_keys) >= 2
        marks["history hours"] = sum(1 for hour in history(hours=48).series if hour.totals.finished) > 1
        return all(marks.values())

    def missing(self) -> str:
        return ", ".join(name for name, seen in self.marks.items() if not seen)
