"""Issue 25: OpenTelemetry tracing, with the real SDK and its InMemorySpanExporter and a real Worker
(in a thread of the test process: its executor threads, event loop and isolated path are the real
ones). A trace is asserted span by span: request -> enqueue -> attempt -> the handler's own span;
a retry's attempt is linked to the enqueuing span, not its child; outcomes, attributes, exceptions."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tasks import tracing
from tasks.conf import get_settings
from tasks.models import FINISHED, Task, TaskStatus
from tasks.worker.process import Worker
from tasks.workflows import chain, step
from tests.helpers import ROOT, child_env, wait_until, worker_in_thread
from tests.helpers.tracing import by_name, global_provider, one
from tests.testapp import traced_handlers

pytestmark = pytest.mark.django_db(transaction=True)

H = "tests.testapp.traced_handlers."


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
def traced_worker(spans: InMemorySpanExporter) -> Iterator[Worker]:
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
    spans: InMemorySpanExporter, traced_worker: Worker
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
    spans: InMemorySpanExporter, traced_worker: Worker
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
    spans: InMemorySpanExporter, traced_worker: Worker
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


def test_an_attempt_handed_back_at_shutdown_ends_its_span_so(spans: InMemorySpanExporter) -> None:
    task_id = Task.objects.enqueue(H + "sleeps", kwargs={"seconds": 2.0}).id
    with worker_in_thread(new_worker()):
        wait_until(
            lambda: Task.objects.filter(pk=task_id, status=TaskStatus.RUNNING, attempts=1).exists(),
            20,
            what="the attempt to start",
        )
    # Stopped twice (no grace): the running attempt went back to the queue, uncharged.
    assert Task.objects.get(pk=task_id).status == TaskStatus.READY
    (attempt,) = ended(spans, f"run {H}sleeps")
    assert attempt.attributes is not None
    assert attempt.attributes["leasing.task.outcome"] == "handed_back"
    assert attempt.status.status_code == StatusCode.UNSET


class BrokenPropagator:
    """An application's propagator that fails (a bug of its own): tracing must not stop the queue."""

    fields: set[str] = {"traceparent"}

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        raise RuntimeError("propagator bug (inject)")

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        raise RuntimeError("propagator bug (extract)")


def test_a_failing_propagator_leaves_tasks_untraced_but_enqueued_and_run(
    spans: InMemorySpanExporter, caplog: Any
) -> None:
    from opentelemetry import propagate

    traced = Task.objects.enqueue(H + "inner", kwargs={"label": "before"}).id  # a context on the row
    assert row_context(traced) is not None
    working = propagate.get_global_textmap()
    propagate.set_global_textmap(BrokenPropagator())  # type: ignore[arg-type]
    try:
        plain = Task.objects.enqueue(H + "noop").id
        assert row_context(plain) is None  # enqueued all the same, without a context
        with worker_in_thread(new_worker()):
            assert finished(traced).status == TaskStatus.SUCCESSFUL  # its extract failed: run untraced
            assert finished(plain).status == TaskStatus.SUCCESSFUL
    finally:
        propagate.set_global_textmap(working)
    assert "the trace context could not be written" in caplog.text
    assert f"task {traced}: its attempt's span could not be started" in caplog.text
    assert not by_name(spans.get_finished_spans(), f"run {H}inner")
    assert len(by_name(spans.get_finished_spans(), f"run {H}noop")) == 1  # no context to extract: traced


# -- the event loop and the isolated path ---------------------------------------------------------


def test_an_async_handlers_attempt_span_is_current_inside_its_coroutine(
    spans: InMemorySpanExporter, traced_worker: Worker
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


# -- the enqueue variants: one span per call ---------------------------------------------------------


def traceparent_of(span: ReadableSpan) -> str:
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def test_a_bulk_enqueue_is_one_span_whose_context_every_row_carries(spans: InMemorySpanExporter) -> None:
    with request_tracer().start_as_current_span("POST /newsletter") as request:
        ids = Task.objects.bulk_enqueue(H + "noop", [{"n": n} for n in range(5)], queue="mail", chunk_size=2)
    (enqueue,) = by_name(spans.get_finished_spans(), f"enqueue {H}noop")  # 3 statements, one span
    assert parent_id(enqueue) == request.get_span_context().span_id
    assert enqueue.kind == SpanKind.PRODUCER
    assert enqueue.attributes is not None
    assert enqueue.attributes["messaging.batch.message_count"] == 5
    assert enqueue.attributes["messaging.destination.name"] == "mail"
    assert enqueue.attributes["leasing.task.path"] == H + "noop"
    contexts = list(Task.objects.filter(pk__in=ids).values_list("trace_context", flat=True))
    assert contexts == [{"traceparent": traceparent_of(enqueue)}] * 5


def test_a_workflow_enqueue_is_one_span_and_each_step_runs_as_its_child(
    spans: InMemorySpanExporter, traced_worker: Worker
) -> None:
    flow = chain(step(H + "inner", label="first step"), step(H + "inner", label="second step"), pipe=False)
    with request_tracer().start_as_current_span("POST /pipeline"):
        enqueued = flow.enqueue()
    for task_id in enqueued.task_ids:
        assert finished(task_id).status == TaskStatus.SUCCESSFUL
    (enqueue,) = by_name(spans.get_finished_spans(), "enqueue workflow chain")
    assert enqueue.attributes is not None
    assert enqueue.attributes["leasing.workflow.id"] == enqueued.id
    assert enqueue.attributes["leasing.workflow.kind"] == "chain"
    assert enqueue.attributes["messaging.batch.message_count"] == 2
    attempts = ended(spans, f"run {H}inner", count=2)
    assert {parent_id(a) for a in attempts} == {enqueue.context.span_id}
    assert sorted(int(str(a.attributes["leasing.task.id"])) for a in attempts if a.attributes) == enqueued.task_ids
    # A dependant enqueued later, after an existing task, carries its own enqueue's context.
    with request_tracer().start_as_current_span("POST /follow-up"):
        later = Task.objects.enqueue(H + "noop", depends_on=[enqueued.task_ids[-1]])
    (dependant,) = by_name(spans.get_finished_spans(), f"enqueue {H}noop")
    assert row_context(later.id) == {"traceparent": traceparent_of(dependant)}


def test_a_django_tasks_enqueue_through_the_backend_is_traced_with_its_alias(
    spans: InMemorySpanExporter, traced_worker: Worker
) -> None:
    with request_tracer().start_as_current_span("POST /signup"):
        result = traced_handlers.dj_inner.enqueue("welcome mail")
    task_id = int(result.id)
    finished(task_id)
    (attempt,) = ended(spans, f"run {H}dj_inner")
    enqueue = one(spans.get_finished_spans(), f"enqueue {H}dj_inner")
    inner = one(spans.get_finished_spans(), "welcome mail")
    assert enqueue.attributes is not None and attempt.attributes is not None
    assert enqueue.attributes["leasing.backend"] == attempt.attributes["leasing.backend"] == "default"
    assert enqueue.attributes["leasing.task.id"] == task_id
    assert parent_id(attempt) == enqueue.context.span_id
    assert parent_id(inner) == attempt.context.span_id


def test_a_deduplicated_enqueue_says_it_created_nothing(spans: InMemorySpanExporter) -> None:
    first = Task.objects.enqueue(H + "noop", dedup_key="nightly")
    again = Task.objects.enqueue(H + "noop", dedup_key="nightly")
    assert (first.id, first.created, again.created) == (again.id, True, False)
    made, kept = by_name(spans.get_finished_spans(), f"enqueue {H}noop")
    assert made.attributes is not None and kept.attributes is not None
    assert (made.attributes["leasing.task.created"], kept.attributes["leasing.task.created"]) == (True, False)
    assert kept.attributes["leasing.task.id"] == first.id
    assert row_context(first.id) == {"traceparent": traceparent_of(made)}  # the row keeps its first context


def test_an_enqueue_that_fails_records_the_error_on_its_span(spans: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError, match="NUL character"):
        Task.objects.enqueue(H + "noop", kwargs={"bad": "\x00"})
    assert not by_name(spans.get_finished_spans(), f"enqueue {H}noop")  # refused before any span: bad input
    with pytest.raises(Exception, match="depends_on names tasks not in database"):
        Task.objects.enqueue(H + "noop", depends_on=[10**12])
    (refused,) = by_name(spans.get_finished_spans(), f"enqueue {H}noop")
    assert refused.status.status_code == StatusCode.ERROR
    assert [event.name for event in refused.events] == ["exception"]
    assert Task.objects.count() == 0


# -- off: nothing stored, nothing imported ---------------------------------------------------------


def test_with_tracing_off_nothing_is_stored_and_no_span_is_made(spans: InMemorySpanExporter, settings: Any) -> None:
    settings.LEASING_TASKS = {"TRACING": False}
    with request_tracer().start_as_current_span("GET /quiet"):
        single = Task.objects.enqueue(H + "noop").id
        bulk = Task.objects.bulk_enqueue(H + "noop", [{}, {}])
        flow = chain(step(H + "noop"), step(H + "noop"), pipe=False).enqueue().task_ids
    assert [s.name for s in spans.get_finished_spans()] == ["GET /quiet"]
    assert set(Task.objects.values_list("trace_context", flat=True)) == {None}
    assert Task.objects.count() == 1 + len(bulk) + len(flow) == 5
    with worker_in_thread(new_worker()):
        finished(single)
        wait_until(lambda: Task.objects.filter(status=TaskStatus.SUCCESSFUL).count() == 5, 20, what="every task")
    assert [s.name for s in spans.get_finished_spans()] == ["GET /quiet"]


def test_by_default_tracing_is_off_until_a_tracer_provider_is_set(settings: Any) -> None:
    settings.LEASING_TASKS = {}
    plain = Task.objects.enqueue(H + "noop").id  # no provider: the API's proxy provider only
    assert row_context(plain) is None
    with global_provider() as exporter:
        with trace.get_tracer("tests.request").start_as_current_span("GET /now"):
            traced = Task.objects.enqueue(H + "noop").id
        assert row_context(traced) is not None
        assert len(by_name(exporter.get_finished_spans(), f"enqueue {H}noop")) == 1
    settings.LEASING_TASKS = {"TRACING": True}  # on: the proxy provider makes spans that record nothing
    forced = Task.objects.enqueue(H + "noop").id
    assert row_context(forced) is None  # no valid context to carry


def test_the_claim_returns_the_context_only_where_the_row_has_one(spans: InMemorySpanExporter) -> None:
    with request_tracer().start_as_current_span("GET /mixed"):
        traced = Task.objects.enqueue(H + "noop", priority=1).id
    plain_settings = {"TRACING": False}
    from django.test import override_settings

    with override_settings(LEASING_TASKS=plain_settings):
        plain = Task.objects.enqueue(H + "noop").id
    enqueue = one(spans.get_finished_spans(), f"enqueue {H}noop")
    claimed = {task.id: task for task in Task.objects.claim("w-claim", limit=2)}
    assert claimed[traced].trace_context == {"traceparent": traceparent_of(enqueue)}
    assert claimed[plain].trace_context is None
    # ... and through the worker's round statement (finish + start + claim), whose rows are a UNION.
    Task.objects.all().delete()
    with request_tracer().start_as_current_span("GET /round"):
        again = Task.objects.enqueue(H + "noop").id
    _, _, round_claimed = Task.objects.finish_start_claim("w-claim", [], [(10**12, 1, None)], limit=1)
    assert [(t.id, t.trace_context) for t in round_claimed] == [(again, row_context(again))]
    assert round_claimed[0].trace_context is not None


def test_a_process_with_tracing_off_never_imports_opentelemetry() -> None:
    """A real process: Django set up, a task enqueued, a worker runs it; opentelemetry is installed
    here but nobody configured a provider, so nothing of it is imported."""
    script = """
import json, sys, django
django.setup()
from tasks.models import Task
from tasks.worker.process import Worker
task_id = Task.objects.enqueue("tests.testapp.handlers.noop").id
Worker(concurrency=1, ttl=5, poll_interval=0.05, install_signal_handlers=False, max_tasks=1, worker_id="plain").run()
row = Task.objects.values("status", "trace_context").get(pk=task_id)
print(json.dumps({"row": row, "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"row": {"status": "SUCCESSFUL", "trace_context": None}, "otel": []}


def test_a_tracing_setting_of_the_wrong_kind_is_refused(settings: Any) -> None:
    from tasks.checks import check_task_settings

    settings.LEASING_TASKS = {"TRACING": "yes"}
    with pytest.raises(ValueError, match=r"LEASING_TASKS\['TRACING'\] must be True, False or None"):
        get_settings()
    assert [e.id for e in check_task_settings()] == ["tasks.E100"]
    settings.LEASING_TASKS = {"TRACING": 1}  # 1 == True, but not a bool
    with pytest.raises(ValueError, match="TRACING"):
        get_settings()


# -- docs/howto/tracing.md -------------------------------------------------------------------------


def test_the_how_to_pages_configuration_block_turns_tracing_on(settings: Any) -> None:
    import re

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from tests.helpers.tracing import reset_provider

    page = (ROOT / "docs" / "howto" / "tracing.md").read_text()
    (block,) = re.findall(r"<!-- tested[^>]*-->\n```python\n(.*?)```", page, re.S)
    settings.LEASING_TASKS = {}
    assert Task.objects.enqueue(H + "noop").id and tracing.tracer() is None
    reset_provider()
    namespace: dict[str, Any] = {}
    try:
        exec(compile(block, "docs/howto/tracing.md", "exec"), namespace)
        assert tracing.tracer() is not None
        seen = InMemorySpanExporter()  # beside the page's console exporter, to read what the provider made
        namespace["provider"].add_span_processor(SimpleSpanProcessor(seen))
        task_id = Task.objects.enqueue(H + "noop").id
        (enqueue,) = seen.get_finished_spans()
        assert row_context(task_id) == {"traceparent": traceparent_of(enqueue)}
        assert enqueue.resource.attributes["service.name"] == "orders"
        namespace["provider"].shutdown()
    finally:
        reset_provider()


# -- durable steps ----------------------------------------------------------------------------------


def test_each_step_is_a_span_of_its_attempt_saying_how_it_ended(
    spans: InMemorySpanExporter, traced_worker: Worker
) -> None:
    """A step run, a wait with no event yet (the attempt suspends), then, woken by its event, the
    stored steps replayed and a step whose function raises: each a ``step <name>`` span, child of
    its attempt's span, its own spans under it, with its outcome."""
    from tasks.steps import send_event

    task_id = Task.objects.enqueue(H + "stepped_and_waiting", kwargs={"event": "paid"}, queue="traced",
                                   max_attempts=1).id  # fmt: skip
    (first,) = ended(spans, f"run {H}stepped_and_waiting")
    assert dict(first.attributes or {})["leasing.task.outcome"] == "snoozed"
    assert send_event(task_id, "paid", {"amount": 3})
    assert finished(task_id).status == TaskStatus.FAILED
    attempts = ended(spans, f"run {H}stepped_and_waiting", 2)
    steps = [s for s in spans.get_finished_spans() if s.name.startswith("step ")]

    def of(attempt: ReadableSpan) -> list[tuple[str, Any, Any]]:
        return [
            (s.name, dict(s.attributes or {})["leasing.step.outcome"], s.status.status_code)
            for s in sorted(steps, key=lambda s: s.start_time or 0)
            if parent_id(s) == attempt.context.span_id
        ]

    assert of(attempts[0]) == [
        ("step reserve", "committed", StatusCode.UNSET),
        ("step wait:paid", "committed", StatusCode.UNSET),
        ("step event:paid", "waiting", StatusCode.UNSET),
    ]
    assert of(attempts[1]) == [
        ("step reserve", "replayed", StatusCode.UNSET),
        ("step wait:paid", "replayed", StatusCode.UNSET),
        ("step event:paid", "committed", StatusCode.UNSET),
        ("step ship", "raised", StatusCode.ERROR),
    ]
    reserve = next(s for s in steps if s.name == "step reserve" and parent_id(s) == attempts[0].context.span_id)
    assert dict(reserve.attributes or {}) == {
        "leasing.step.name": "reserve",
        "leasing.step.position": 0,
        "leasing.task.id": task_id,
        "leasing.task.attempt": 1,
        "leasing.task.token": dict(attempts[0].attributes or {})["leasing.task.token"],
        "leasing.step.outcome": "committed",
    }
    inside = one(spans.get_finished_spans(), "inside reserved")
    assert parent_id(inside) == reserve.context.span_id, "the step's span is current inside its function"
    ship = next(s for s in steps if s.name == "step ship")
    assert [e.attributes["exception.type"] for e in ship.events if e.attributes] == ["KeyError"]


def test_a_step_the_fence_refuses_ends_its_span_as_lease_lost(spans: InMemorySpanExporter, current: None) -> None:
    """The step ran, but its attempt no longer held the task when it came to commit (recovery had
    requeued it): its writes are rolled back and its span says lease_lost, with status ERROR."""
    from tasks.exceptions import TaskLeaseLost
    from tasks.runtime import _set_current
    from tasks.steps import step
    from tests.db.test_steps import QUEUE, attempt, take_away

    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    _set_current(attempt(task_id, "w1"))
    with pytest.raises(TaskLeaseLost):
        step("charge", lambda: take_away(task_id))
    (span,) = by_name(spans.get_finished_spans(), "step charge")
    assert dict(span.attributes or {})["leasing.step.outcome"] == "lease_lost"
    assert span.status.status_code == StatusCode.ERROR
