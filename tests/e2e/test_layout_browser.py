"""Every dashboard page stays inside the layout at 1280 px, with the longest values the models allow.

Each page is screenshotted (into ``$SCREENSHOT_DIR`` when set, else the test's temporary
directory) and fails when the document scrolls sideways (scrollWidth > clientWidth); the message
names the elements that stick out.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from leasing.models import Lease
from tasks.demo import generator
from tasks.maintenance.history import roll_up_hours
from tasks.models import Failure, GeneratorState, Task, Worker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.slow]

# The longest values each column allows, without a space to break at.
WORKER = "worker-" + "w" * 193  # Worker.id / holder: 200
QUEUE = "queue-" + "q" * 94  # 100
PATH = "tests.testapp.handlers." + "h" * 232  # task_path: 255
RESOURCE = "resource:" + "r" * 246  # 255
WORD = "x" * 3000  # in JSON, messages and tracebacks: no column limit

OVERFLOW = """() => {
  const root = document.scrollingElement;
  const limit = root.clientWidth;
  const culprits = Array.from(document.querySelectorAll("body *"))
    .filter((el) => el.getBoundingClientRect().right > limit + 1)
    .slice(0, 5)
    .map((el) => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + (el.className ? "." + el.className : ""));
  return {scrollWidth: root.scrollWidth, clientWidth: limit, culprits};
}"""


def claim_one(queue: str = QUEUE) -> Any:
    claimed = Task.objects.claim(WORKER, limit=1, queues=[queue], ttl=300)
    assert len(claimed) == 1
    return claimed[0]


def seed_long_everything() -> dict[str, int]:
    """A task in every state, leases in every state, workers and the generator, all with values
    as long as their columns allow."""

    def enqueue(label: str) -> int:
        return Task.objects.enqueue(
            PATH, kwargs={"label": label, "payload": WORD}, queue=QUEUE, dedup_key=f"{label}-" + "d" * 240
        ).id

    ids = {name: enqueue(name) for name in ("running", "stuck", "retrying", "failed", "succeeded")}
    traceback = "Traceback (most recent call last):\n" + f'  File "{WORD}.py", line 1\n' * 20 + f"ValueError: {WORD}"
    for name in ("running", "stuck", "retrying", "failed", "succeeded"):
        task = claim_one()
        assert task.id == ids[name]
        Task.objects.checkpoint(task.id, WORKER, task.token, {"cursor": WORD})
        if name == "stuck":
            Task.objects.filter(pk=task.id).update(expires_at=timezone.now() - dt.timedelta(seconds=5))
        elif name in ("retrying", "failed"):
            failure = Failure(task.id, task.token, "builtins." + "E" * 200, WORD, traceback, retry=name == "retrying")
            Task.objects.fail(failure, WORKER)
        elif name == "succeeded":
            Task.objects.complete(task.id, WORKER, task.token, {"result": WORD})
    ids["pending"] = enqueue("pending")
    ids["cancelled"] = enqueue("cancelled")
    Task.objects.filter(pk=ids["cancelled"]).cancel()
    held = Task.objects.bulk_enqueue(PATH, ({"n": n} for n in range(12)), queue=QUEUE)
    Task.objects.claim(WORKER, limit=len(held), queues=[QUEUE], ttl=300)

    for state in ("active", "renewed", "expired", "released"):
        resource = f"{state}-{RESOURCE}"[:255]
        grant = Lease.objects.acquire(resource, WORKER, ttl=0.01 if state == "expired" else 300)
        assert grant is not None
        if state == "renewed":
            Lease.objects.renew(resource, WORKER, grant.token, ttl=300)
        if state == "released":
            Lease.objects.release(resource, WORKER, grant.token)

    stats = {"succeeded": 10**12, "failed": 10**12, "rejected": 10**12, "lost": 10**12}
    stats.update({f"counter_{'c' * 40}_{n}": 10**12 for n in range(20)})
    queues = [f"{QUEUE[:-1]}{n}" for n in range(6)]
    Worker.objects.create(
        id=WORKER, hostname="host-" + "n" * 250, pid=4_194_304, queues=queues, concurrency=512, stats=stats, running=17
    )
    Worker.objects.create(
        id=WORKER[:-1] + "2",
        hostname="host-" + "n" * 250,
        pid=4_194_303,
        queues=queues,
        concurrency=512,
        stats=stats,
        stopped_at=timezone.now(),
        stop_reason="presumed dead: " + "s" * 185,
    )
    generator.set_state(running=True, rate=2)
    GeneratorState.objects.filter(name="default").update(leader=WORKER, queue=QUEUE)
    return ids


def test_every_dashboard_page_fits_1280_px(browser_page: Any, live_server: Any, tmp_path: Path) -> None:
    ids = seed_long_everything()
    # The finished ones in the history too (an hour counted: the longest queue and path in its filters and table).
    Task.objects.filter(pk__in=[ids["succeeded"], ids["failed"]]).update(
        finished_at=timezone.now() - dt.timedelta(hours=2)
    )
    roll_up_hours()
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    page = browser_page
    page.context.add_cookies(
        [
            {
                "name": settings.SESSION_COOKIE_NAME,
                "value": client.cookies[settings.SESSION_COOKIE_NAME].value,
                "url": live_server.url,
            }
        ]
    )
    assert page.viewport_size["width"] == 1280

    # The all-tasks page with every filter set, each value as long as its column allows: the box and
    # its chips wrap inside the window too.
    every_filter = urlencode(
        {
            "status": ["Failed", "Cancelled", "Ready"],
            "queue": QUEUE,
            "task_path": PATH,
            "workflow": str(2**63 - 1),
            **{key: f"{key}-" + "k" * (254 - len(key)) for key in ("dedup_key", "concurrency_key", "rate_key")},
            **{key: f"{key}-" + "k" * (254 - len(key)) for key in ("fair_key", "debounce_key")},
            "enqueued_after": "2000-01-01T00:00:00+00:00",
            "enqueued_before": "2999-12-31T23:59:59.999999+00:00",
            "q": "d" * 1000,
        },
        doseq=True,
    )
    pages = {
        "overview": "/dashboard/",
        "tasks-all": "/dashboard/tasks/",
        "tasks-all-filtered": f"/dashboard/tasks/?{every_filter}",
        **{f"tasks-{state}": f"/dashboard/tasks/{state}/" for state in ids},
        **{f"task-{state}": f"/dashboard/tasks/{task_id}/" for state, task_id in ids.items()},
        "workers": "/dashboard/workers/",
        "worker": f"/dashboard/workers/{WORKER}/",
        "worker-stopped": f"/dashboard/workers/{WORKER[:-1]}2/",
        "generator": "/dashboard/generator/",
        "history": "/dashboard/history/",
        "leases": "/leases/",
        **{f"leases-{state}": f"/leases/{state}/" for state in ("active", "renewed", "expired", "released")},
    }
    shots = Path(os.environ.get("SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    overflowing = {}
    for name, url in pages.items():
        response = page.goto(live_server.url + url)
        assert response is not None and response.status == 200, (url, response and response.status)
        assert page.url == live_server.url + url, page.url  # not sent to the log-in page
        page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
        measured = page.evaluate(OVERFLOW)
        if measured["scrollWidth"] > measured["clientWidth"]:
            overflowing[url] = measured
    assert not overflowing, f"pages wider than the window (screenshots in {shots}): {overflowing}"

    # The long values are really on the pages (a page that hid them would pass trivially).
    page.goto(live_server.url + "/dashboard/workers/")
    assert page.locator("#workers tbody tr").count() == 1
    assert page.locator("#workers td.mono a").inner_text() == WORKER
    page.goto(live_server.url + f"/dashboard/tasks/{ids['failed']}/")
    assert WORD in page.locator("main").inner_text()
    page.goto(live_server.url + pages["tasks-all-filtered"])
    assert page.locator("#task-chips a[data-filter]").count() == 11  # every filter but the statuses
    assert page.locator("#task-chips a.chip.on[data-status]").count() == 3
