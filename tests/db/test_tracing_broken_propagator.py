"""Tracing (tasks/tracing.py): an application's propagator that does not raise but
writes what jsonb cannot hold, or what JSON cannot express, into the carrier. tasks/tracing.py
promises "a broken propagator of the application's must not stop the enqueue": the carrier is written
by ``propagate.inject`` inside a try, but turned into the row's ``trace_context`` by ``json.dumps``
outside it, and stored without the storable check every other jsonb value gets
(tasks/lifecycle/storable.py). Then the enqueue fails (a TypeError, or PostgreSQL refusing the row),
and with it every row of a bulk enqueue; a real worker must run what was enqueued.

Found by breaker 32 (the bug hunt on issue 25's operations: bulk operations, history, tracing, test helpers)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tasks.models import FINISHED, Task, TaskStatus
from tests.helpers import wait_until, worker_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

H = "tests.testapp.traced_handlers."


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
                lambda task_id=task_id: Task.objects.filter(pk=task_id, status__in=FINISHED).first(),  # type: ignore[misc]
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


def test_a_bulk_retried_tasks_run_is_linked_to_its_enqueue_not_a_child_of_it(spans: InMemorySpanExporter) -> None:
    """tasks/tracing.py: a run after one that was charged "starts a trace of its own, LINKED to the
    enqueuing span, so a request's trace shows its task and a retry storm does not grow that trace
    forever". A bulk retry (or a requeue) resets ``attempts`` to 0 and keeps ``trace_context``: the
    task's next run is taken for a first attempt and becomes a child of the original request's
    enqueue span, however old; each further bulk retry adds another run to that trace."""
    from opentelemetry import trace

    from tasks.maintenance.bulk import BulkRunner
    from tasks.models import BulkOperation
    from tests.helpers.tracing import by_name, one

    with trace.get_tracer("tests.request").start_as_current_span("POST /import"):
        task_id = Task.objects.enqueue(H + "always_fails", kwargs={"message": "down"}, max_attempts=1).id
    with worker_in_thread_default():
        wait_until(lambda: Task.objects.filter(pk=task_id, status="FAILED").exists(), 20, what="the failure")
        for _ in range(2):
            BulkOperation.objects.request("retry", {"task_path": H + "always_fails"})
            BulkRunner().run_until_idle()
            wait_until(
                lambda: (
                    Task.objects.filter(pk=task_id, status="FAILED", attempts=1).exists()
                    and len(by_name(spans.get_finished_spans(), f"run {H}always_fails")) >= 1
                ),
                20,
                what="the retried run to fail again",
            )
        runs = wait_until(
            lambda: found if len(found := by_name(spans.get_finished_spans(), f"run {H}always_fails")) >= 3 else None,
            20,
            what="three runs",
        )
    enqueue = one(spans.get_finished_spans(), f"enqueue {H}always_fails")
    first, *retried = sorted(runs, key=lambda span: span.start_time or 0)
    assert first.parent is not None and first.parent.span_id == enqueue.context.span_id
    in_the_requests_trace = [span for span in retried if span.context.trace_id == enqueue.context.trace_id]
    assert not in_the_requests_trace, (
        f"{len(in_the_requests_trace)} bulk-retried run(s) joined the request's trace as children of its enqueue"
    )
    assert all(any(link.context.span_id == enqueue.context.span_id for link in span.links) for span in retried), (
        "a bulk-retried run is not linked to its enqueue"
    )
