"""``manage.py run_worker ARGS`` as a process's own program, whose worker thread raises (a stand-in
for a bug in the dispatcher) once it has written its first outcomes, with a non-daemon thread left
behind as task code may leave one (tests/concurrency/test_worker_thread_raises.py)."""

from __future__ import annotations

import threading
from typing import Any

from django.core.management import ManagementUtility

from tasks.worker.dispatcher import Dispatcher

LEFT_BEHIND = threading.Event()  # never set: the thread waits for ever


def main(argv: list[str]) -> int:
    original = Dispatcher.round

    def round_(self: Dispatcher, outcomes: Any, *args: Any, **kwargs: Any) -> Any:
        claimed = original(self, outcomes, *args, **kwargs)
        if outcomes:
            raise RuntimeError("a bug in the dispatcher")
        return claimed

    Dispatcher.round = round_  # type: ignore[method-assign]
    threading.Thread(target=LEFT_BEHIND.wait, name="left-by-task-code").start()  # not a daemon
    ManagementUtility(["manage.py", "run_worker", *argv]).execute()
    return 0
