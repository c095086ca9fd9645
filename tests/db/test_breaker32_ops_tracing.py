"""Breaker of issue 25 (tracing, tasks/tracing.py): an application's propagator that does not raise but
writes what jsonb cannot hold, or what JSON cannot express, into the carrier. tasks/tracing.py
promises "a broken propagator of the application's must not stop the enqueue": the carrier is written
by ``propagate.inject`` inside a try, but turned into the row's ``trace_context`` by ``json.dumps``
outside it, and stored without the storable check every other jsonb value gets
(tasks/lifecycle/storable.py). Then the enqueue fails (a TypeError, or PostgreSQL refusing the row),
and with it every row of a bulk enqueue; a real worker must run what was enqueued."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tasks.models import FINISHED, Task, TaskStatus
from tests.helpers import wait_until, worker_in_thread
from tests.helpers.tracing import global_provider

pytestmark = pytest.mark.django_db(transaction=True)

H = "tests.testapp.traced_handlers."


@pytest.fixture
def spans(settings: Any) -> Iterator[InMemorySpanExporter]:
    settings.LEASING_TASKS = {"BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05}
    with global_provider() as exporter:
        yield exporter


class WritesJunk:
    """A propagator that writes ``value`` under its field: no exception, a carrier jsonb refuses."""

    fields = {"x-junk"}

    def __init__(self, value: Any) -> None:
        self.value = value

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        carrier["traceparent"] = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        carrier["x-junk"] = self.value

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        from opentelemetry.context import Context

        return context if context is not None else Context()


JUNK = {
    "nul": "abc\x00def",
    "surrogate": "\ud800",
    "nan": float("nan"),
    "bytes": b"\x01\x02",
    "object": object(),
}


@pytest.mark.parametrize("kind", sorted(JUNK))
def test_a_propagator_writing_unstorable_values_does_not_stop_the_enqueue(
    spans: InMemorySpanExporter, kind: str
) -> None:
    from opentelemetry import propagate

    working = propagate.get_global_textmap()
    propagate.set_global_textmap(WritesJunk(JUNK[kind]))  # type: ignore[arg-type]
    try:
        failures: list[str] = []
        ids: list[int] = []
        try:
            ids.append(Task.objects.enqueue(H + "noop").id)
        except Exception as exc:
            failures.append(f"enqueue: {type(exc).__name__}: {exc}")
        try:
            ids += Task.objects.bulk_enqueue(H + "noop", [{}, {}, {}])
        except Exception as exc:
            failures.append(f"bulk_enqueue: {type(exc).__name__}: {exc}")
    finally:
        propagate.set_global_textmap(working)
    assert not failures, failures
    assert len(ids) == 4
    with worker_in_thread_default():
        for task_id in ids:
            task = wait_until(
                lambda task_id=task_id: Task.objects.filter(pk=task_id, status__in=FINISHED).first(),
                20,
                what=f"task {task_id} to end",
            )
            assert task.status == TaskStatus.SUCCESSFUL


def worker_in_thread_default() -> Any:
    from tasks.worker.process import Worker

    return worker_in_thread(
        Worker(
            concurrency=2,
            ttl=5,
            poll_interval=0.05,
            recovery_interval=0.1,
            install_signal_handlers=False,
            worker_id="breaker32-traced",
            queues=["default"],
        )
    )
