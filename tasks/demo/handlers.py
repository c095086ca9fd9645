"""The demo's feature handlers: what the showcase (tasks/demo/showcase.py) and the demo project's
schedule enqueue, so that the dashboard has every state and feature to show within two minutes.

They stand for the kinds of work a team runs: a call to a flaky partner API (retried to success), a
card charge that a bank declines for good, a mail provider behind a rate limit, a tenant's import in
a fair queue, a report waiting for its data (snoozes), the steps of a workflow. Each raises the
exception class a real one would, with a message a team would recognise.
"""

from __future__ import annotations

import random
import time
from typing import Any

from tasks.exceptions import Snooze


def _work(seconds: float) -> None:
    from tasks.runtime import current_task

    run = current_task()
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        run.check()
        time.sleep(min(0.1, left))


def _attempt() -> int:
    from tasks.runtime import current_task

    return int(current_task().attempt)


def sync_partner(partner: str, *, fail_attempts: int = 1) -> dict[str, Any]:
    """A partner API that resets the connection on the first attempt(s), then answers: retried to
    success."""
    attempt = _attempt()
    if attempt <= fail_attempts:
        if attempt % 2:
            raise ConnectionResetError(104, f"Connection reset by peer (api.{partner}.example)")
        raise TimeoutError(f"read timed out after 10.0s (api.{partner}.example)")
    _work(0.2)
    return {"partner": partner, "synced": random.randint(1, 40), "attempt": attempt}


class CardDeclined(Exception):
    """The payment provider refused the charge."""


def charge_card(order: int, amount_cents: int) -> dict[str, Any]:
    """A charge the bank declines on every attempt: FAILED once its attempts are spent."""
    _work(0.1)
    reason = random.choice(["insufficient_funds", "card_expired", "do_not_honor"])
    raise CardDeclined(f"order {order}: charge of {amount_cents / 100:.2f} EUR declined ({reason})")


def send_email(to: str, template: str) -> dict[str, Any]:
    """A mail provider's call, behind the demo's ``demo-smtp`` rate key."""
    _work(0.05)
    return {"to": to, "template": template, "message_id": f"<{random.getrandbits(48):x}@mail.example>"}


def import_rows(tenant: str, rows: int) -> dict[str, Any]:
    """A tenant's import, in the demo's fair queue."""
    _work(min(0.5, rows / 1000))
    return {"tenant": tenant, "rows": rows}


def build_report(report: str, *, snoozes: int = 2) -> dict[str, Any]:
    """A report whose data is not ready yet: it snoozes ``snoozes`` times (uncharged), then runs."""
    from tasks.models import Task
    from tasks.runtime import current_task

    # The claim does not return the counter (fewer columns on the hot path): read it from the row.
    snoozed = Task.objects.filter(pk=current_task().id).values_list("snoozes", flat=True).get()
    if snoozed < snoozes:
        raise Snooze(3)
    _work(0.3)
    return {"report": report, "snoozed": snoozed}


def export_csv(export: str) -> dict[str, Any]:
    """An export behind a concurrency key of one: a second one waits BLOCKED."""
    _work(1.5)
    return {"export": export, "bytes": random.randint(10_000, 90_000)}


# -- workflow steps ------------------------------------------------------------------------------


def resize(image: int) -> dict[str, Any]:
    _work(random.uniform(0.2, 0.8))
    return {"image": image, "width": 640}


def publish_album(album: str) -> dict[str, Any]:
    """A group's callback: runs once, when every resize is final."""
    from tasks.workflows import parent_results

    outcomes = parent_results()
    return {"album": album, "published": sum(1 for o in outcomes if o.succeeded), "of": len(outcomes)}


def fetch_feed(url: str) -> str:
    _work(0.3)
    if "broken" in url:
        raise ValueError(f"feed {url}: expected XML, got text/html (HTTP 200)")
    return f"<rss>{url}</rss>"


def parse_feed(document: str) -> int:
    _work(0.2)
    return len(document)


def store_items(count: int) -> dict[str, Any]:
    _work(0.1)
    return {"stored": count}


def nightly_digest() -> dict[str, Any]:
    """The demo project's scheduled task (LEASING_TASKS["SCHEDULES"]["demo-digest"])."""
    _work(0.2)
    return {"digest": "sent"}
