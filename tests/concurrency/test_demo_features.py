"""The demo shows every feature (issue 41: in its first two minutes on a quiet machine): ``manage.py demo`` as a user
starts it, its real processes on the test database, watched until each feature has left its mark.

Beside the generator's sleep tasks (with their injected crashes and stalls), the showcase
(tasks/demo/showcase.py) enqueues retried and failing handlers, workflows, rate-limited mail, a fair
queue and snoozing reports; the demo project declares a schedule; the demo's start backfills the
history. Nothing here sleeps: each poll reads the rows, and the test ends when all has been seen.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.demo import backfill
from tasks.models import ActivityHour
from tests.helpers import wait_until
from tests.helpers.demo import Seen, running_demo

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

#: A ceiling, not the promise: the issue's two minutes are a figure of the machine (a quiet one shows
#: every feature in about one); what must hold at any speed is that every feature shows.
SECONDS = float(os.environ.get("DEMO_FEATURES_SECONDS", "600"))


def test_the_demo_shows_every_feature(tmp_path: Path) -> None:
    seen = Seen()
    with running_demo(tmp_path) as demo:
        try:
            wait_until(seen.poll, SECONDS, interval=1.0, what="every feature of the demo")
        except AssertionError:
            raise AssertionError(f"not seen in {SECONDS:.0f}s: {seen.missing()}\n{demo.log_tail()}") from None
        assert demo.proc.poll() is None, "the demo exited"
        # The backfilled hours are the demo's, and say so: their rows are in the demo-backfill queue only.
        assert set(ActivityHour.objects.values_list("queue", flat=True).distinct()) == {backfill.QUEUE}
