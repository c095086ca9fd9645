"""Issue 25: OpenTelemetry tracing, with the real SDK and its InMemorySpanExporter and a real Worker
(in a thread of the test process: its executor threads, event loop and isolated path are the real
ones). A trace is asserted span by span: request -> enqueue -> attempt -> the handler's own span;
a retry's attempt is linked to the enqueuing span, not its child; outcomes, attributes, exceptions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tasks.conf import get_settings
from tasks.models import FINISHED, Task, TaskStatus
from tasks.worker.process import Worker
from tests.helpers import wait_until, worker_in_thread
from tests.helpers.tracing import by_name, global_provider, one

pytestmark = pytest.mark.django_db(transaction=True)

H = "tests.testapp.traced_handlers."


@pytest.fixture
def spans(settings: Any) -> Iterator[InMemorySpanExporter]:
    settings.LEASING_TASKS = {"BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05}  # TRACING: the default (None)
    with global_provider() as exporter:
        yield exporter


def new_worker() -> Worker:
    return Worker(
        concurrency=2,
        ttl=5,
        poll_interval=0.05,
        recovery_interval=0.1,
        install_signal_handlers=False,
        worker_id="traced",
        queues=["default", "traced"],
    )


@pytest.fixture
def worker(spans: InMemorySpanExporter) -> Iterator[Worker]:
    with worker_in_thread(new_worker()) as running:
        yield running


def request_tracer() -> trace.Tracer:
    return trace.get_tracer("tests.request")


def ended(exporter: InMemorySpanExporter, name: str, count: int = 1) -> list[ReadableSpan]:
    """The finished spans named ``name``, once there are ``count`` of them (oldest first)."""
    return wait_until(
        lambda: found if len(found := by_name(exporter.get_finished_spans(), name)) >= count else None,
        20,
        what=f"{count} span(s) named {name!r}",
    )


def finished(task_id: int) -> Task:
    return wait_until(
        lambda: Task.objects.filter(pk=task_id, status__in=FINISHED).first(), 20, what=f"task {task_id} to end"
    )


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def row_context(task_id: int) -> Any:
    return Task.objects.values_list("trace_context", flat=True).get(pk=task_id)


# -- one trace from the request to the handler ----------------------------------------------------


def test_a_request_its_enqueue_the_attempt_and_the_handlers_span_are_one_trace(
    spans: InMemorySpanExporter, worker: Worker
) -> None:
    with request_tracer().start_as_current_span("GET /orders") as request:
        task_id = Task.objects.enqueue(H + "inner", kwargs={"label": "charge card"}, queue="traced").id
    assert finished(task_id).status == TaskStatus.SUCCESSFUL
    (attempt,) = ended(spans, f"run {H}inner")
    finished_spans = spans.get_finished_spans()
    root = one(finished_spans, "GET /orders")
    enqueue = one(finished_spans, f"enqueue {H}inner")
    handler = one(finished_spans, "charge card")

    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in (root, enqueue, attempt, handler)} == {trace_id}
    assert root.parent is None
    assert parent_id(enqueue) == root.context.span_id
    assert parent_id(attempt) == enqueue.context.span_id
    assert parent_id(handler) == attempt.context.span_id  # the attempt's span is current in the handler
    assert attempt.links == ()

    assert enqueue.kind == SpanKind.PRODUCER
    assert dict(enqueue.attributes or {}) == {
        "messaging.system": "django-leasing",
        "messaging.operation.type": "send",
        "messaging.operation.name": "enqueue",
        "messaging.destination.name": "traced",
        "messaging.message.id": str(task_id),
        "leasing.task.queue": "traced",
        "leasing.task.path": H + "inner",
        "leasing.task.id": task_id,
        "leasing.task.created": True,
    }
    assert attempt.kind == SpanKind.CONSUMER
    row = Task.objects.get(pk=task_id)
    assert row.worker_ids[0].startswith("traced:")
    assert dict(attempt.attributes or {}) == {
        "messaging.system": "django-leasing",
        "messaging.operation.type": "process",
        "messaging.operation.name": "run",
        "messaging.destination.name": "traced",
        "messaging.message.id": str(task_id),
        "leasing.task.id": task_id,
        "leasing.task.path": H + "inner",
        "leasing.task.queue": "traced",
        "leasing.task.attempt": 1,
        "leasing.task.token": row.token,
        "leasing.worker.id": row.worker_ids[0],
        "leasing.executor": "thread",
        "leasing.task.outcome": "success",
        "leasing.task.status": "SUCCESSFUL",
    }
    assert attempt.status.status_code == StatusCode.UNSET
    assert attempt.events == ()
    # The row carries the enqueuing span's W3C context.
    carried = row_context(task_id)
    flags = enqueue.context.trace_flags
    assert flags.sampled
    assert carried == {"traceparent": f"00-{trace_id:032x}-{enqueue.context.span_id:016x}-{flags:02x}"}


def test_a_retried_tasks_second_attempt_starts_its_own_trace_linked_to_the_enqueue(
    spans: InMemorySpanExporter, worker: Worker
) -> None:
    with request_tracer().start_as_current_span("POST /import"):
        task_id = Task.objects.enqueue(H + "fails_first", kwargs={"message": "flaky upstream"}, max_attempts=3).id
    row = finished(task_id)
    assert (row.status, row.attempts) == (TaskStatus.SUCCESSFUL, 2)
    first, second = ended(spans, f"run {H}fails_first", count=2)
    enqueue = one(spans.get_finished_spans(), f"enqueue {H}fails_first")
    first_inner = one(spans.get_finished_spans(), "inner attempt 1")
    second_inner = one(spans.get_finished_spans(), "inner attempt 2")

    # The first attempt: the enqueuing span's child, retried, its exception recorded.
    assert parent_id(first) == enqueue.context.span_id
    assert first.context.trace_id == enqueue.context.trace_id
    assert first.links == ()
    assert first.attributes is not None
    assert (first.attributes["leasing.task.attempt"], first.attributes["leasing.task.outcome"]) == (1, "retried")
    assert first.attributes["leasing.task.status"] == TaskStatus.READY
    assert first.status.status_code == StatusCode.ERROR
    assert first.status.description == "builtins.ValueError"
    (event,) = first.events
    assert event.name == "exception"
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "flaky upstream"
    assert "fails_first" in str(event.attributes["exception.stacktrace"])
    assert parent_id(first_inner) == first.context.span_id

    # The retry: a new trace (no parent), LINKED to the enqueuing span.
    assert second.parent is None
    assert second.context.trace_id != enqueue.context.trace_id
    (link,) = second.links
    assert (link.context.trace_id, link.context.span_id) == (enqueue.context.trace_id, enqueue.context.span_id)
    assert dict(link.attributes or {}) == {"leasing.link": "enqueue"}
    assert second.attributes is not None
    assert (second.attributes["leasing.task.attempt"], second.attributes["leasing.task.outcome"]) == (2, "success")
    assert second.events == ()
    assert parent_id(second_inner) == second.context.span_id
    assert second_inner.context.trace_id == second.context.trace_id


def test_an_attempt_that_fails_for_good_times_out_snoozes_or_cancels_says_so(
    spans: InMemorySpanExporter, worker: Worker
) -> None:
    failing = Task.objects.enqueue(H + "always_fails", kwargs={"message": "no such order"}, max_attempts=1).id
    timing_out = Task.objects.enqueue(H + "sleeps", kwargs={"seconds": 1.0}, timeout=0.2, max_attempts=1).id
    snoozing = Task.objects.enqueue(H + "snoozes_once", kwargs={"seconds": 0.05}).id
    cancelling = Task.objects.enqueue(H + "cancels", kwargs={"reason": "order withdrawn"}).id
    for task_id in (failing, timing_out, snoozing, cancelling):
        finished(task_id)

    (failed,) = ended(spans, f"run {H}always_fails")
    assert failed.attributes is not None
    assert (failed.attributes["leasing.task.outcome"], failed.attributes["leasing.task.status"]) == ("failed", "FAILED")
    assert failed.status.status_code == StatusCode.ERROR
    (event,) = failed.events
    assert event.attributes is not None
    assert (event.attributes["exception.type"], event.attributes["exception.message"]) == (
        "LookupError",
        "no such order",
    )

    (timed_out,) = ended(spans, f"run {H}sleeps")
    assert timed_out.attributes is not None
    assert timed_out.attributes["leasing.task.outcome"] == "timeout"
    assert timed_out.attributes["leasing.task.retried"] is False
    assert timed_out.status.status_code == StatusCode.ERROR
    (event,) = timed_out.events
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "tasks.exceptions.TaskTimeout"

    # A snooze is not an attempt: the run after it is the same attempt resumed, the enqueue's child again.
    snoozed, woke = ended(spans, f"run {H}snoozes_once", count=2)
    enqueue = one(spans.get_finished_spans(), f"enqueue {H}snoozes_once")
    assert snoozed.attributes is not None and woke.attributes is not None
    assert (snoozed.attributes["leasing.task.outcome"], woke.attributes["leasing.task.outcome"]) == (
        "snoozed",
        "success",
    )
    assert parent_id(snoozed) == parent_id(woke) == enqueue.context.span_id
    assert snoozed.status.status_code == StatusCode.UNSET
    assert snoozed.events == ()

    (cancelled,) = ended(spans, f"run {H}cancels")
    assert cancelled.attributes is not None
    assert cancelled.attributes["leasing.task.outcome"] == "cancelled"
    assert cancelled.attributes["leasing.task.status"] == "CANCELLED"
    assert cancelled.status.status_code == StatusCode.UNSET  # the handler's own decision, not an error
    (event,) = cancelled.events
    assert event.attributes is not None
    assert event.attributes["exception.message"] == "order withdrawn"


# -- the event loop and the isolated path ---------------------------------------------------------


def test_an_async_handlers_attempt_span_is_current_inside_its_coroutine(
    spans: InMemorySpanExporter, worker: Worker
) -> None:
    with request_tracer().start_as_current_span("GET /report"):
        ok = Task.objects.enqueue(H + "async_inner", kwargs={"label": "render"}).id
        bad = Task.objects.enqueue(H + "async_fails", kwargs={"message": "missing"}, max_attempts=1).id
    finished(ok)
    finished(bad)
    (attempt,) = ended(spans, f"run {H}async_inner")
    enqueue = one(spans.get_finished_spans(), f"enqueue {H}async_inner")
    inner = one(spans.get_finished_spans(), "render")
    assert attempt.attributes is not None
    assert attempt.attributes["leasing.executor"] == "async"
    assert attempt.attributes["leasing.task.outcome"] == "success"
    assert parent_id(attempt) == enqueue.context.span_id
    assert parent_id(inner) == attempt.context.span_id
    assert inner.context.trace_id == enqueue.context.trace_id

    (failed,) = ended(spans, f"run {H}async_fails")
    assert failed.attributes is not None
    assert (failed.attributes["leasing.executor"], failed.attributes["leasing.task.outcome"]) == ("async", "failed")
    (event,) = failed.events
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "KeyError"


def test_an_isolated_attempt_is_traced_like_any_other(spans: InMemorySpanExporter) -> None:
    with request_tracer().start_as_current_span("POST /poison"):
        task_id = Task.objects.enqueue(H + "inner", kwargs={"label": "alone"}).id
    # Its workers vanished twice beside other attempts (ISOLATE_AFTER): it runs alone in its process,
    # its start marked before its handler runs (a suspect).
    Task.objects.filter(pk=task_id).update(shared_crashes=get_settings().ISOLATE_AFTER)
    with worker_in_thread(new_worker()):
        finished(task_id)
        (attempt,) = ended(spans, f"run {H}inner")
    inner = one(spans.get_finished_spans(), "alone")
    enqueue = one(spans.get_finished_spans(), f"enqueue {H}inner")
    assert attempt.attributes is not None
    assert attempt.attributes["leasing.executor"] == "isolated"
    assert (attempt.attributes["leasing.task.attempt"], attempt.attributes["leasing.task.outcome"]) == (1, "success")
    assert parent_id(attempt) == enqueue.context.span_id
    assert parent_id(inner) == attempt.context.span_id
