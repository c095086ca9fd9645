"""API claims of a fair queue and the shared cursor: a rejected claim request (a body
the API refuses, a ``?db=`` naming another database than the queue's) reads and writes nothing and
leaves the process's cursor where it was; a client's own cursor deals on from it.

Found by breaker 34 (the bug hunt on the shared fair cursor)."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.models import FairCursor, Task
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = [
    pytest.mark.django_db(databases=["default", "second"], transaction=True),
    pytest.mark.usefixtures("fair_queue_api"),
]

QUEUE = "fair"
KEYS = [f"t{n:02d}" for n in range(8)]


def test_rejected_claims_change_nothing_and_the_next_deals_on(client: Any) -> None:
    for key in KEYS:
        Task.objects.bulk_enqueue(NOOP, [{}], queue=QUEUE, fair_key=key)
    FairCursor.objects.create(queue=QUEUE, fair_after="t02", updated_at="2026-01-01T00:00:00Z")
    api = Api(client)
    for url, body in [
        ("/api/tasks/next?db=second", {"worker": "ext", "queues": [QUEUE]}),
        ("/api/tasks/next", {"worker": "ext", "queues": [QUEUE], "limit": 0}),
        ("/api/tasks/next", {"worker": "ext", "queues": [QUEUE], "fair_after": "x" * 300}),
    ]:
        status, reply = api.call("POST", url, body)
        assert status == 400, reply
    assert list(FairCursor.objects.values_list("fair_after", flat=True)) == ["t02"]
    assert not Task.objects.filter(queue=QUEUE).exclude(status="READY").exists()
    status, reply = api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": [QUEUE]})
    assert status == 200 and reply["task"]["fair_key"] == "t03", reply
    # a client's own cursor: its turn, and where this process's next claims go on
    status, reply = api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": [QUEUE], "fair_after": "t05"})
    assert reply["task"]["fair_key"] == "t06" and reply["fair_after"] == "t06", reply
    status, reply = api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": [QUEUE]})
    assert reply["task"]["fair_key"] == "t07", reply
