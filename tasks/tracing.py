"""OpenTelemetry spans for the queue (the ``otel`` extra): one span per enqueue call, one per attempt.

An enqueue inside a traced web request and the attempts that run its task are one trace:

- ``Task.objects.enqueue`` (and through it the django.tasks backend's enqueue and the JSON API's),
  ``bulk_enqueue`` and a workflow's ``enqueue`` each open one PRODUCER span, **one per call** (a bulk
  enqueue of 10,000 rows is one span), and store its context on every row they insert, as the
  configured propagator writes it (W3C ``traceparent`` / ``tracestate`` by default), in the row's
  ``trace_context`` column;
- a worker opens one CONSUMER span per attempt, current while the handler runs (spans the handler
  makes are its children), ended when the attempt's outcome is recorded, with that outcome. The
  task's **first** attempt is a child of the enqueuing span; a **retry** (any attempt after one that
  was charged: a failure, a timeout, a crash) starts a trace of its own, LINKED to the enqueuing
  span, so a request's trace shows its task and a retry storm does not grow that trace forever. A
  snoozed task's next run is the same attempt resumed (snoozes are not charged): a child again.

Nothing of OpenTelemetry is imported, and nothing is stored on the row (``trace_context`` stays
NULL), while tracing is off: ``LEASING_TASKS["TRACING"] = False``, or (the default, None) while no
tracer provider is configured. A provider can only be configured by code that imported
``opentelemetry.trace``, so the default looks in ``sys.modules`` before it looks at the provider:
a process without OpenTelemetry pays one dictionary lookup per enqueue and per attempt.

Attribute names: docs/howto/tracing.md (the ``messaging.*`` ones follow OpenTelemetry's messaging
semantic conventions; the rest are this project's, under ``leasing.``).
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tasks.conf import get_settings

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

# The worker's Execution and Outcome (tasks/runtime.py, tasks/worker/ledger.py) are layers above this
# module (models enqueue through it), so they are typed as Any here.
Execution = Any
Outcome = Any

#: The instrumentation scope's name (what a backend shows as the library that made the spans).
SCOPE = "django-leasing"
SYSTEM = "django-leasing"

#: The dispatcher's names for how an attempt ended (tasks/worker/dispatcher.py) -> the span's outcome.
OUTCOMES = {
    "succeeded": "success",
    "retried": "retried",
    "failed": "failed",
    "discarded": "failed",
    "snoozed": "snoozed",
    "cancelled": "cancelled",
}
#: Outcomes that set the span's status to ERROR (a snooze or a cancel is the handler's own decision).
_ERRORS = {"failed", "retried", "timeout"}

logger = logging.getLogger("tasks.tracing")

# (provider, tracer): a provider is set once per process, so this is the tracer from then on.
_cached: tuple[Any, Any] = (None, None)


def tracer() -> Tracer | None:
    """The tracer, when tracing is on right now (``LEASING_TASKS["TRACING"]``); else None, with
    nothing of OpenTelemetry imported."""
    setting = get_settings().TRACING
    if setting is False:
        return None
    trace: Any = sys.modules.get("opentelemetry.trace")
    if trace is None:
        if setting is None:
            return None  # nobody imported OpenTelemetry: no tracer provider can have been set
        trace = importlib.import_module("opentelemetry.trace")
    provider = trace.get_tracer_provider()
    if setting is None and isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    global _cached
    cached_provider, cached_tracer = _cached
    if cached_provider is provider:
        return cached_tracer
    found = provider.get_tracer(SCOPE, _version())
    _cached = (provider, found)
    return found


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("django-leasing")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return None


# -- the enqueue side ---------------------------------------------------------------------------------


@contextmanager
def enqueuing(
    tracer: Tracer, name: str, queue: str | None, attributes: Mapping[str, Any] | None = None
) -> Iterator[tuple[Span, str | None]]:
    """A PRODUCER span around one enqueue call, current inside the block; yields it and its context
    as the rows' ``trace_context`` (JSON text: what the configured propagator writes; None when it
    writes nothing, as for a span that is not sampled and has no parent). ``queue``: None for a
    workflow (its steps may be in several). An exception leaving the block is recorded on the span."""
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    described: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "enqueue",
    }
    if queue is not None:
        described["messaging.destination.name"] = described["leasing.task.queue"] = queue
    with tracer.start_as_current_span(
        f"enqueue {name}", kind=SpanKind.PRODUCER, attributes={**described, **(attributes or {})}
    ) as span:
        carrier: dict[str, str] = {}
        written: str | None = None
        try:
            propagate.inject(carrier)
            if carrier:
                written = _storable_carrier(carrier)
        except Exception:  # a broken propagator of the application's must not stop the enqueue
            logger.warning("the trace context could not be written; the task is enqueued without it", exc_info=True)
        yield span, written


def _storable_carrier(carrier: dict[Any, Any]) -> str:
    """The carrier as the JSON text the row keeps: text keys and values only, none that jsonb cannot
    hold (NUL, lone surrogates). Raises ValueError otherwise (a propagator writing bytes,
    NaN or NUL stopped the enqueue)."""
    for key, value in carrier.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"the propagator wrote a {type(value).__name__} under {key!r}, not text")
        for text in (key, value):
            if "\x00" in text:
                raise ValueError("the propagator wrote a NUL character")
            text.encode()  # UnicodeEncodeError (a ValueError) for a lone surrogate
    return json.dumps(carrier)


#: A key of the stored context that marks a run again of a finished task (an operator's requeue, a
#: bulk retry): its attempts start from 0 again, yet its runs are linked to the enqueue, not its
#: children (TaskQuerySet.requeue and tasks/lifecycle/bulk.py write it).
RERUN_KEY = "leasing-rerun"


# -- the worker side ----------------------------------------------------------------------------------


def start_attempt(execution: Execution, executor: str) -> None:
    """Open the attempt's span (``execution.span``) as its handler is about to run; ``executor``:
    "thread", "async" or "isolated". Nothing when tracing is off. Never raises: it runs on an
    executor outside the attempt's guard (invariant 9), so a failure only leaves the attempt untraced."""
    found = tracer()
    if found is None:
        return
    try:
        _start_attempt(found, execution, executor)
    except Exception:
        logger.warning("task %d: its attempt's span could not be started", execution.id, exc_info=True)
        execution.span = None


def _start_attempt(found: Tracer, execution: Execution, executor: str) -> None:
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context

    task = execution.task
    parent = Context()  # a new trace unless this is the first attempt of a traced enqueue
    links: list[trace.Link] = []
    if isinstance(task.trace_context, dict) and task.trace_context:
        enqueued = propagate.extract(task.trace_context)
        if task.attempts == 0 and RERUN_KEY not in task.trace_context:
            parent = enqueued
        else:
            context = trace.get_current_span(enqueued).get_span_context()
            if context.is_valid:
                links.append(trace.Link(context, {"leasing.link": "enqueue"}))
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "run",
        "messaging.destination.name": task.queue,
        "messaging.message.id": str(task.id),
        "leasing.task.id": task.id,
        "leasing.task.path": task.task_path,
        "leasing.task.queue": task.queue,
        "leasing.task.attempt": execution.attempt,
        "leasing.task.token": task.token,
        "leasing.worker.id": execution.worker_id,
        "leasing.executor": executor,
    }
    if task.backend_alias is not None:
        attributes["leasing.backend"] = task.backend_alias
    execution.span = found.start_span(
        f"run {task.task_path}", context=parent, kind=trace.SpanKind.CONSUMER, links=links, attributes=attributes
    )


def enter(execution: Execution) -> object:
    """Make the attempt's span current in this thread or coroutine while its handler runs (only
    called when it has one); :func:`leave` with what this returns (None: it could not be made current)."""
    from opentelemetry import context, trace

    try:
        return context.attach(trace.set_span_in_context(execution.span))
    except Exception:
        logger.warning("task %d: its attempt's span could not be made current", execution.id, exc_info=True)
        return None


def leave(token: object) -> None:
    from opentelemetry import context

    if token is not None:  # (the API logs a failed detach; it does not raise)
        context.detach(token)  # type: ignore[arg-type]


def end_attempt(execution: Execution, outcome: str, ended: Outcome | None = None, status: str | None = None) -> None:
    """End the attempt's span (once; nothing if it has none) with its ``outcome`` (one of
    :data:`OUTCOMES`' values, "timeout", "rejected": the outcome was refused, the lease was lost, or
    "handed_back"), the ``status`` stored, and the exception the attempt ended with, if any."""
    span = execution.span
    if span is None:
        return
    execution.span = None
    try:
        _end(span, execution, outcome, ended, status)
    except Exception:  # on the dispatcher's thread: a tracing failure must not stop the worker
        logger.warning("task %d: its attempt's span could not be ended", execution.id, exc_info=True)


def _end(span: Span, execution: Execution, outcome: str, ended: Outcome | None, status: str | None) -> None:
    error = ended.error if ended is not None else None
    from opentelemetry.trace import Status, StatusCode

    from tasks.exceptions import EventLoopBlocked, TaskTimeout

    if isinstance(error, TaskTimeout | EventLoopBlocked) and outcome in ("retried", "failed"):
        span.set_attribute("leasing.task.retried", outcome == "retried")
        outcome = "timeout"
    span.set_attribute("leasing.task.outcome", outcome)
    span.set_attribute("leasing.task.attempt", execution.attempt)  # a suspect's START may have told it anew
    if status is not None:
        span.set_attribute("leasing.task.status", status)
    if error is not None:
        span.record_exception(error)
    if outcome in _ERRORS:
        failure = ended.failure if ended is not None else None
        span.set_status(Status(StatusCode.ERROR, failure.exception_class_path if failure is not None else outcome))
    elif outcome == "rejected":
        span.set_status(Status(StatusCode.ERROR, execution.lost_reason or "the outcome was refused: lease lost"))
    span.end()


# -- durable steps ------------------------------------------------------------------------------------

#: How a step ended (tasks/steps.py) -> whether its span's status is ERROR.
STEP_OUTCOMES = {
    "committed": False,  # it ran, and its transaction stored its result
    "replayed": False,  # an earlier attempt stored it: its result returned, nothing ran
    "waiting": False,  # a wait's event step found no event yet: rolled back, the task suspends
    "lease_lost": True,  # the fence refused its commit: its writes rolled back
    "raised": True,  # its function (or the step's own checks) raised: rolled back
}


@contextmanager
def stepping(execution: Execution, name: str, position: int) -> Iterator[dict[str, str]]:
    """An INTERNAL span ``step <name>`` around one step (a child of the attempt's span, current in
    the handler), current inside the block. The block sets ``outcome`` in the dict it is given (one
    of :data:`STEP_OUTCOMES`); an exception leaving it without one is "raised", recorded on the span.
    Nothing when tracing is off; a tracing failure never reaches the step."""
    ended: dict[str, str] = {}
    found = tracer()
    span = None
    if found is not None:
        try:
            from opentelemetry.trace import SpanKind

            span = found.start_span(
                f"step {name}",
                kind=SpanKind.INTERNAL,
                attributes={
                    "leasing.step.name": name,
                    "leasing.step.position": position,
                    "leasing.task.id": execution.id,
                    "leasing.task.attempt": execution.attempt,
                    "leasing.task.token": execution.token,
                },
            )
        except Exception:
            logger.warning("task %d: step %r's span could not be started", execution.id, name, exc_info=True)
    if span is None:
        yield ended
        return
    from opentelemetry import trace

    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield ended
    except BaseException as error:
        _end_step(span, execution, ended.get("outcome", "raised"), error)
        raise
    _end_step(span, execution, ended.get("outcome", "committed"), None)


def _end_step(span: Span, execution: Execution, outcome: str, error: BaseException | None) -> None:
    try:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("leasing.step.outcome", outcome)
        if STEP_OUTCOMES.get(outcome, True):
            if error is not None and outcome == "raised":
                span.record_exception(error)
            described = outcome if error is None else f"{outcome}: {type(error).__name__}"
            span.set_status(Status(StatusCode.ERROR, described))
        span.end()
    except Exception:
        logger.warning("task %d: a step's span could not be ended", execution.id, exc_info=True)
