"""The demo shows every feature in its first two minutes (issue 41): ``manage.py demo`` as a user
starts it, its real processes on the test database, watched until each feature has left its mark.

Beside the generator's sleep tasks (with their injected crashes and stalls), the showcase
(tasks/demo/showcase.py) enqueues retried and failing handlers, workflows, rate-limited mail, a fair
queue and snoozing reports; the demo project declares a schedule; the demo's start backfills the
history. Nothing here sleeps: each poll reads the rows, and the test ends when all has been seen.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tasks.demo import backfill, showcase
from tasks.models import ActivityHour, Task, Workflow
from tasks.web.history import history
from tasks.web.queries import STATES
from tests.helpers import start_manage, stop_process, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.serial]

#: The issue's promise is two minutes; a loaded machine gets a little more before the test says no.
SECONDS = float(os.environ.get("DEMO_FEATURES_SECONDS", "180"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Seen:
    """What the polls have observed so far."""

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


def test_the_demo_shows_every_feature_within_two_minutes(tmp_path: Path) -> None:
    port = free_port()
    demo = start_manage(tmp_path / "demo.log", "demo", "--port", str(port))
    seen = Seen()
    try:
        try:
            wait_until(seen.poll, SECONDS, interval=1.0, what="every feature of the demo")
        except AssertionError:
            log = (tmp_path / "demo.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"not seen in {SECONDS:.0f}s: {seen.missing()}\n{log}") from None
        assert demo.poll() is None, "the demo exited"
        # The backfilled hours are the demo's, and say so: their rows are in the demo-backfill queue only.
        assert set(ActivityHour.objects.values_list("queue", flat=True).distinct()) == {backfill.QUEUE}
    finally:
        stop_process(demo)
