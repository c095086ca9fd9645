"""docs/howto/retries.md: the blocks marked "tested" run as written, on a real worker."""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from tasks.models import FINISHED, Task, TaskStatus
from tasks.worker.process import Worker
from tests.helpers import ROOT, wait_until, worker_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = ROOT / "docs" / "howto" / "retries.md"


def marked_blocks() -> list[str]:
    return re.findall(r"<!-- tested: tests/db/test_retries_doc.py[^>]*-->\n```python\n(.*?)```", PAGE.read_text(), re.S)


@pytest.fixture
def example(settings: Any) -> Iterator[types.ModuleType]:
    """The page's tested blocks as one importable module (the worker imports handlers by path)."""
    settings.LEASING_TASKS = {"BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05}
    module = types.ModuleType("retries_doc_example")
    reports = {1: {"status": "generating", "format": "csv"}, 2: None, 3: {"status": "done", "format": "xls"}}
    calls: list[int] = []

    def fetch_report(report_id: int) -> dict[str, Any] | None:
        return reports[report_id]

    def push_to_crm(account_id: int) -> None:
        calls.append(account_id)
        if len(calls) == 1:
            raise module.RateLimited(0.05)

    module.__dict__.update(fetch_report=fetch_report, store=lambda report: report["format"], push_to_crm=push_to_crm)
    for block in marked_blocks():
        exec(compile(block, str(PAGE), "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    worker = Worker(concurrency=2, ttl=5, poll_interval=0.05, install_signal_handlers=False, worker_id="doc")
    try:
        with worker_in_thread(worker):
            yield module
    finally:
        del sys.modules[module.__name__]


def ended(task_id: int) -> Task:
    return wait_until(lambda: Task.objects.filter(pk=task_id, status__in=FINISHED).first(), 20, what="the task")


def test_the_page_has_its_marked_blocks() -> None:
    assert len(marked_blocks()) == 2


def test_the_handler_examples_do_what_the_page_says(example: types.ModuleType) -> None:
    path = "retries_doc_example."
    generating = Task.objects.enqueue(path + "import_report", args=[1], max_attempts=1).id
    snoozed = wait_until(lambda: Task.objects.filter(pk=generating, snoozes=1, status="READY").first(), 20)
    assert (snoozed.attempts, snoozed.failures, snoozed.errors) == (0, 0, [])
    assert 29 < (snoozed.run_after - snoozed.snoozed_at).total_seconds() < 30.1
    deleted = ended(Task.objects.enqueue(path + "import_report", args=[2]).id)
    assert (deleted.status, deleted.cancel_reason) == (TaskStatus.CANCELLED, "report 2 was deleted")
    unknown = ended(Task.objects.enqueue(path + "import_report", args=[3], max_attempts=5).id)
    assert (unknown.status, unknown.attempts) == (TaskStatus.FAILED, 1)
    assert unknown.errors[-1]["exception_class_path"] == "tasks.exceptions.Discard"

    synced = ended(Task.objects.enqueue(path + "sync_account", args=[7]).id)
    assert (synced.status, synced.attempts, synced.max_attempts) == (TaskStatus.SUCCESSFUL, 2, 8)
    assert synced.errors[0]["message"] == "retry after 0.05s"
