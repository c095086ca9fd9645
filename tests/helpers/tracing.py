"""The real OpenTelemetry SDK for the tracing tests: a tracer provider exporting to memory, set as
the process's global provider for one test and taken away after it (so that other tests run with
tracing off, as they would without a provider)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


@contextmanager
def global_provider() -> Iterator[InMemorySpanExporter]:
    """An SDK TracerProvider with an in-memory exporter as the global provider for the block.

    The API lets a process set its provider once; the SDK's own test utilities
    (opentelemetry-test-utils, ``reset_trace_globals``) reset the same two globals between tests."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reset_provider()
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        reset_provider()


def reset_provider() -> None:
    """No tracer provider set, as in a process that never set one."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def one(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], name: str) -> ReadableSpan:
    found = by_name(spans, name)
    assert len(found) == 1, f"{len(found)} spans named {name!r} among {[s.name for s in spans]}"
    return found[0]
