"""Structured logs (docs/howto/production.md, "Structured logs"): a worker process configured with the
page's LOGGING prints JSON lines whose records about a task carry task_id, queue, attempt, worker_id
and, where an attempt ends, outcome; the fields cost nothing on records the level filters out."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from tasks.models import FINISHED, Task
from tasks.runtime import Execution
from tasks.worker.process import Worker
from tests.helpers import ROOT, start_manage, stop_process, wait_until, worker_in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PAGE = ROOT / "docs" / "howto" / "production.md"
QUEUE = "jsonlogs"


def documented_logging() -> dict[str, Any]:
    (block,) = re.findall(
        r"<!-- tested: tests/concurrency/test_json_logs.py[^>]*-->\n```python\n(.*?)```", PAGE.read_text(), re.S
    )
    namespace: dict[str, Any] = {}
    exec(block, namespace)
    return dict(namespace["LOGGING"])


def test_a_worker_process_logs_json_lines_with_the_task_fields(tmp_path: Path) -> None:
    ok = Task.objects.enqueue("tests.testapp.handlers.echo", args=["fine"], queue=QUEUE).id
    bad = Task.objects.enqueue(
        "tests.testapp.testing_handlers.fail_always", args=["json"], queue=QUEUE, max_attempts=1
    ).id
    log = tmp_path / "worker.log"
    proc = start_manage(
        log,
        "run_worker",
        *("--queues", QUEUE, "--worker-id", "jsonlog", "--max-tasks", "2", "--no-recovery", "--no-scheduler"),
        LEASING_TEST_LOGGING=json.dumps(documented_logging()),
    )
    try:
        wait_until(
            lambda: Task.objects.filter(pk__in=[ok, bad], status__in=FINISHED).count() == 2, 60, what="both tasks"
        )
        assert proc.wait(60) == 0
    finally:
        stop_process(proc)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object: nothing else is printed

    def about(task_id: int) -> list[dict[str, Any]]:
        return [r for r in records if r.get("task_id") == task_id and r["logger"] == "tasks.worker"]

    (succeeded,) = about(ok)
    assert succeeded["level"] == "INFO" and succeeded["message"].startswith(
        f"task {ok} tests.testapp.handlers.echo succeeded"
    )
    assert (succeeded["queue"], succeeded["attempt"], succeeded["outcome"]) == (QUEUE, 1, "succeeded")
    worker_id = succeeded["worker_id"]
    assert worker_id.startswith("jsonlog:") and worker_id == Task.objects.get(pk=ok).worker_ids[0]
    (failed,) = about(bad)
    assert failed["level"] == "WARNING" and "FAILED for good" in failed["message"]
    assert (failed["queue"], failed["attempt"], failed["worker_id"], failed["outcome"]) == (
        QUEUE,
        1,
        worker_id,
        "failed",
    )
    started = [r for r in records if r["message"].startswith(f"worker {worker_id} started")]
    assert started and started[0]["worker_id"] == worker_id and "time" in started[0]


def test_records_the_level_filters_out_build_no_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str | None] = []
    fields = Execution.log_fields

    def counting(self: Execution, outcome: str | None = None) -> dict[str, Any]:
        built.append(outcome)
        return fields(self, outcome)

    monkeypatch.setattr(Execution, "log_fields", counting)
    worker_logger = logging.getLogger("tasks.worker")
    original = worker_logger.level
    # setLevel, not an attribute set: it also clears the loggers' isEnabledFor cache, which an
    # earlier test of this process may have filled at INFO (an attribute set then left INFO on).
    worker_logger.setLevel(logging.WARNING)
    try:
        ids = [Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id for _ in range(5)]
        worker = Worker(
            queues=[QUEUE], install_signal_handlers=False, recovery=False, scheduler=False, poll_interval=0.05
        )
        with worker_in_thread(worker):
            wait_until(lambda: Task.objects.filter(pk__in=ids, status="SUCCESSFUL").count() == 5, 30, what="the tasks")
        assert built == []  # five successes at WARNING: no dictionary built
        worker_logger.setLevel(logging.INFO)
        more = [Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id for _ in range(3)]
        worker = Worker(
            queues=[QUEUE], install_signal_handlers=False, recovery=False, scheduler=False, poll_interval=0.05
        )
        with worker_in_thread(worker):
            wait_until(lambda: Task.objects.filter(pk__in=more, status="SUCCESSFUL").count() == 3, 30, what="the tasks")
        assert built == ["succeeded"] * 3
    finally:
        worker_logger.setLevel(original)
    worker_logger.setLevel(original)
