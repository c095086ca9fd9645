"""docs/howto/durable-steps.md: the block marked "tested" runs as written, on a real worker: a
shipment that fails once is retried without charging again."""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from tasks.models import Task, TaskStep
from tasks.worker.process import Worker
from tests.helpers import ROOT, wait_until, worker_in_thread
from tests.testapp.models import Once

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = ROOT / "docs" / "howto" / "durable-steps.md"


def marked_blocks() -> list[str]:
    return re.findall(r"<!-- tested: tests/db/test_steps_doc.py[^>]*-->\n```python\n(.*?)```", PAGE.read_text(), re.S)


@pytest.fixture
def example(settings: Any) -> Iterator[tuple[types.ModuleType, dict[str, list[Any]]]]:
    settings.LEASING_TASKS = {"BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05}
    module = types.ModuleType("steps_doc_example")
    calls: dict[str, list[Any]] = {"charge": [], "book": []}

    def mark_charged(order_id: int) -> None:
        Once.objects.create(key=f"charged {order_id}")  # a second commit of the step would raise

    class Payments:
        def charge(self, order_id: int, idempotency_key: str) -> str:
            calls["charge"].append(idempotency_key)
            return f"pay-{order_id}"

    class Carrier:
        def book(self, order_id: int, reference: str) -> str:
            calls["book"].append(reference)
            if len(calls["book"]) == 1:
                raise ConnectionError("the carrier timed out")
            return f"parcel-{order_id}"

    module.__dict__.update(mark_charged=mark_charged, payments=Payments(), carrier=Carrier())
    [block] = marked_blocks()
    exec(compile(block, str(PAGE), "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    worker = Worker(concurrency=2, ttl=5, poll_interval=0.05, install_signal_handlers=False, worker_id="doc")
    try:
        with worker_in_thread(worker):
            yield module, calls
    finally:
        del sys.modules[module.__name__]


def test_a_failed_shipment_is_retried_without_charging_again(
    example: tuple[types.ModuleType, dict[str, list[Any]]],
) -> None:
    _module, calls = example
    task_id = Task.objects.enqueue("steps_doc_example.fulfil", args=[7], max_attempts=3).id
    task = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 30, what="the order")
    assert (task.attempts, task.return_value) == (2, "pay-7")
    assert calls == {"charge": [f"task-{task_id}-step-0-charge"], "book": ["pay-7", "pay-7"]}
    assert Once.objects.filter(key="charged 7").count() == 1
    assert list(TaskStep.objects.filter(task_id=task_id).values_list("name", "attempt")) == [
        ("charge", 1),
        ("ship", 2),
    ]
