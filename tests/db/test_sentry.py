"""Handler failures in Sentry (tasks/worker/sentry.py): the real sentry_sdk, initialised by the block of
docs/howto/monitoring.md as written, sends its events over HTTP to a local endpoint that keeps them;
the worker's statements run inline (``run_until_empty``)."""

from __future__ import annotations

import gzip
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import sentry_sdk

from tasks.exceptions import Snooze
from tasks.models import Task
from tasks.testing import run_until_empty
from tests.helpers import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = ROOT / "docs" / "howto" / "monitoring.md"


def boom(reason: str) -> None:
    raise LookupError(reason)


def snoozes() -> None:
    raise Snooze(600)


class Endpoint(ThreadingHTTPServer):
    """A Sentry ingest endpoint on loopback: keeps the events of the envelopes posted to it."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def dsn(self) -> str:
        return f"http://public@127.0.0.1:{self.server_address[1]}/1"


class _Handler(BaseHTTPRequestHandler):
    server: Endpoint

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        lines = body.split(b"\n")
        # An envelope: its header, then (item header, item payload) pairs; the events are "event" items.
        for header, payload in zip(lines[1::2], lines[2::2], strict=False):
            if header and json.loads(header).get("type") == "event":
                self.server.events.append(json.loads(payload))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[Endpoint]:
    server = Endpoint()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("SENTRY_DSN", server.dsn)
    try:
        yield server
    finally:
        sentry_sdk.get_client().close(timeout=5)  # what it still sends goes out while the endpoint listens
        sentry_sdk.init()  # no DSN: the client is inactive again for the tests that follow
        server.shutdown()
        server.server_close()


def init_as_documented() -> None:
    (block,) = re.findall(r"<!-- tested: tests/db/test_sentry.py -->\n```python\n(.*?)```", PAGE.read_text(), re.S)
    exec(compile(block, str(PAGE), "exec"), {})


def test_a_handler_failure_reaches_sentry_with_its_task(endpoint: Endpoint) -> None:
    init_as_documented()
    failed = Task.objects.enqueue(f"{__name__}.boom", args=["no such invoice"], queue="sentry", max_attempts=1).id
    snoozed = Task.objects.enqueue(f"{__name__}.snoozes", queue="sentry").id
    run_until_empty(["sentry"])
    sentry_sdk.flush(timeout=10)
    assert Task.objects.get(pk=failed).status == "FAILED"
    assert Task.objects.get(pk=snoozed).status == "READY"  # snoozed: a decision, not an error
    (event,) = endpoint.events
    (exception,) = event["exception"]["values"]
    assert (exception["type"], exception["value"]) == ("LookupError", "no such invoice")
    tags = event["tags"]
    assert tags["leasing.task.id"] == str(failed)
    assert tags["leasing.task.path"] == f"{__name__}.boom"
    assert (tags["leasing.queue"], tags["leasing.attempt"], tags["leasing.retryable"]) == ("sentry", "1", "True")
    context = event["contexts"]["leasing task"]
    assert (context["id"], context["max_attempts"], context["database"]) == (failed, 1, "default")


def test_without_the_integration_nothing_is_sent(endpoint: Endpoint) -> None:
    sentry_sdk.init(dsn=endpoint.dsn)  # Sentry itself, but not LeasingIntegration
    Task.objects.enqueue(f"{__name__}.boom", args=["quiet"], queue="sentry", max_attempts=1)
    run_until_empty(["sentry"])
    sentry_sdk.flush(timeout=10)
    assert endpoint.events == []
