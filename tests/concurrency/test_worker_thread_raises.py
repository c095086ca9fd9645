"""A ``run_worker`` process whose worker thread raises (a bug in the dispatcher, say) ends, with a
non-zero status, even when task code left a non-daemon thread behind; what it held is handed back.
Before: the exception ended the worker's thread and the command, and the interpreter then waited
for ever on the thread task code left: a process alive, serving nothing, that no supervisor restarts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tasks.models import Task, TaskStatus
from tests.helpers import ROOT, child_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."
ARGS = ("--concurrency", "2", "--batch-size", "4", "--ttl", "5", "--poll-interval", "0.2")
HANG = 60.0  # a bound on a hang, not a measure of speed


def test_an_exception_in_the_worker_thread_ends_the_process(tmp_path: Path) -> None:
    quick = Task.objects.enqueue(H + "noop").id
    slow = [Task.objects.enqueue(H + "work", kwargs={"seconds": 30}).id for _ in range(3)]
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.child", "raising_worker", "--worker-id", "raiser", *ARGS],
            cwd=ROOT,
            env=child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        code = proc.wait(HANG)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the worker did not exit after its thread raised:\n{log.read_text()[-3000:]}")
    assert code == 1, log.read_text()[-3000:]
    assert "a bug in the dispatcher" in log.read_text()
    assert Task.objects.get(pk=quick).status == TaskStatus.SUCCESSFUL
    # Nothing left RUNNING under the dead worker's lease: the rest was handed back on the way out.
    assert not Task.objects.filter(pk__in=slow, status=TaskStatus.RUNNING).exists()
    assert not Task.objects.filter(pk__in=slow, attempts__gt=1).exists()
