"""The demo's showcase: beside the generator's sleep tasks (and their injected crashes and stalls),
a little of every other feature, at small rates, so that the dashboard shows each within seconds.

The generator's leader calls :meth:`Showcase.due` on each round, inside its fenced transaction: a
deposed leader enqueues nothing. What is enqueued, and how often (seconds):

- ``sync_partner`` every 10: a connection reset / a timeout on its first attempt(s), then success;
- ``charge_card`` every 20: declined on both of its two attempts, FAILED (three a minute);
- five ``send_email`` every 5 under the rate key ``demo-smtp`` at ``2/s``: refusals, in line;
- the fair queue ``demo-fair`` every 5: six imports of a noisy tenant, one of each of three quiet ones;
- ``build_report`` every 15: snoozes twice, 3 s each, then runs;
- two ``export_csv`` every 10 under the concurrency key ``demo-export`` (limit 1): one waits BLOCKED;
- a group of four resizes then a callback every 30; a chain fetch -> parse -> store every 15, every
  other one on a broken feed, so the first step fails and the rest are CANCELLED.

Only the demo project turns it on (``DEMO_SHOWCASE`` in project/settings.py, set by ``manage.py
demo``); the schedule and the fair queue are declared there too.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from django.conf import settings

HANDLERS = "tasks.demo.handlers"
FAIR_QUEUE = "demo-fair"
RATE_KEY = "demo-smtp"
RATE_LIMIT = "2/s"
NOISY_TENANT = "tenant:acme"
QUIET_TENANTS = ("tenant:bakery", "tenant:clinic", "tenant:dojo")


def enabled() -> bool:
    return bool(getattr(settings, "DEMO_SHOWCASE", False))


@dataclass
class Showcase:
    """Calls each feature's enqueue when its period has passed (the first round: all of them)."""

    counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _next: dict[str, float] = field(default_factory=dict)

    def due(self, now: float) -> int:
        """Enqueue what is due at ``now`` (a monotonic time); returns the tasks enqueued."""
        enqueued = 0
        for name, (period, enqueue) in self.features().items():
            if now >= self._next.get(name, 0.0):
                self._next[name] = now + period
                enqueued += enqueue()
        return enqueued

    def features(self) -> dict[str, tuple[float, Callable[[], int]]]:
        return {
            "retried": (10.0, self.retried),
            "failing": (20.0, self.failing),
            "rate_limited": (5.0, self.rate_limited),
            "fair": (5.0, self.fair),
            "snoozing": (15.0, self.snoozing),
            "blocked": (10.0, self.blocked),
            "group": (30.0, self.group),
            "chain": (15.0, self.chain),
        }

    def retried(self) -> int:
        from tasks.models import Task

        n = next(self.counter)
        Task.objects.enqueue(
            f"{HANDLERS}.sync_partner",
            args=[random.choice(["stripe", "hubspot", "shopify"])],
            kwargs={"fail_attempts": 1 + n % 2},
            max_attempts=4,
        )
        return 1

    def failing(self) -> int:
        from tasks.models import Task

        order = 10_000 + next(self.counter)
        Task.objects.enqueue(
            f"{HANDLERS}.charge_card", args=[order, random.randint(500, 25_000)], max_attempts=2, priority=1
        )
        return 1

    def rate_limited(self) -> int:
        from tasks.models import Task

        batch = [{"to": f"user{next(self.counter)}@example.com", "template": "welcome"} for _ in range(5)]
        Task.objects.bulk_enqueue(f"{HANDLERS}.send_email", batch, rate_key=RATE_KEY, rate_limit=RATE_LIMIT)
        return len(batch)

    def fair(self) -> int:
        from tasks.models import Task

        Task.objects.bulk_enqueue(
            f"{HANDLERS}.import_rows",
            [{"tenant": NOISY_TENANT, "rows": random.randint(100, 400)} for _ in range(6)],
            queue=FAIR_QUEUE,
            fair_key=NOISY_TENANT,
        )
        for tenant in QUIET_TENANTS:
            Task.objects.enqueue(
                f"{HANDLERS}.import_rows",
                kwargs={"tenant": tenant, "rows": random.randint(10, 100)},
                queue=FAIR_QUEUE,
                fair_key=tenant,
            )
        return 6 + len(QUIET_TENANTS)

    def snoozing(self) -> int:
        from tasks.models import Task

        Task.objects.enqueue(f"{HANDLERS}.build_report", args=[f"weekly-{next(self.counter)}"])
        return 1

    def blocked(self) -> int:
        from tasks.models import Task

        for _ in range(2):
            Task.objects.enqueue(
                f"{HANDLERS}.export_csv",
                args=[f"export-{next(self.counter)}"],
                concurrency_key="demo-export",
                concurrency_limit=1,
            )
        return 2

    def group(self) -> int:
        from tasks.workflows import group, step

        album = f"album-{next(self.counter)}"
        images = [random.randint(1, 99_999) for _ in range(4)]
        group(
            [step(f"{HANDLERS}.resize", image) for image in images],
            then=step(f"{HANDLERS}.publish_album", album),
            name=f"publish {album}",
        ).enqueue()
        return len(images) + 1

    def chain(self) -> int:
        from tasks.workflows import chain, step

        n = next(self.counter)
        url = f"https://{'broken' if n % 2 else 'news'}.example/feed/{n}.xml"
        chain(
            step(f"{HANDLERS}.fetch_feed", url).options(max_attempts=1),
            step(f"{HANDLERS}.parse_feed"),
            step(f"{HANDLERS}.store_items"),
            name=f"ingest feed {n}",
        ).enqueue()
        return 3
