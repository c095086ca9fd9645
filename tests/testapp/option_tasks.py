"""django.tasks Tasks with this queue's ``@task(...)`` options (tests/db/test_task_options.py): the typed
decorator of tasks.backends, and Django's own for one (the options reach the backend either way)."""

from __future__ import annotations

from typing import Any

from tasks.backends import task
from tasks.compat import task as django_task


class Flaky(Exception):
    """Retried by ``send_invoice`` (its ``retry_on``)."""


class Fatal(Exception):
    """Not among ``send_invoice``'s ``retry_on``: the first one fails the task."""


def later(attempt: int, exc: BaseException) -> float:
    return 600.0


@task(
    max_attempts=3,
    retry_on=[Flaky],
    backoff=later,
    timeout=5,
    rate_key="smtp:{customer_id}",
    rate_limit="10/s",
    concurrency_key="invoice:{customer_id}",
    concurrency_limit=2,
    fair_key="{customer_id}",
)
def send_invoice(customer_id: int, invoice_id: int, raises: str | None = None) -> Any:
    if raises == "flaky":
        raise Flaky(invoice_id)
    if raises == "fatal":
        raise Fatal(invoice_id)
    return {"sent": invoice_id}


@task(queue_name="reports", dedup_key="report:{0}", unique_for=3600)
def build_report(name: str) -> str:
    return name


@task(dedup_key="search:{0}", debounce=60, max_wait=300)
def reindex(name: str) -> str:
    return name


@django_task(max_attempts=7)  # type: ignore[call-overload]  # django-stubs' task() knows no options
def plain(value: int) -> int:
    return value
