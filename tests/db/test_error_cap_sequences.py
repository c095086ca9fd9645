"""Every writer of capped_errors in one history, past the cap: the worker's failure and its handler's
cancel-less snooze (no entry, nothing dropped), the hand-back of a started attempt (an entry) and of an
unstarted claim (none), recovery of a crashed attempt, then the bulk discard. After every step the
error list is the first entry and the newest nine of everything written, ``errors_dropped`` counts the
rest exactly, and the newest entry is last."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from tasks.lifecycle.fragments import MAX_ERRORS
from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Failure, Task
from tests.db.test_attempt_history_attacks import QUEUE, claim

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "tests.testapp.handlers.noop"


def check(task_id: int, written: list[str]) -> None:
    task = Task.objects.get(pk=task_id)
    kept = written if len(written) <= MAX_ERRORS else written[:1] + written[-(MAX_ERRORS - 1) :]
    assert [e.get("message") for e in task.errors] == kept
    assert task.errors_dropped == len(written) - len(kept)


def test_fail_snooze_hand_back_recover_and_discard_past_the_cap() -> None:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=1000).id
    written: list[str] = []
    reason = "interrupted by a worker shutting down; not counted as a failure"
    for round_ in range(8):
        token = claim(task_id, f"f{round_}")
        assert Task.objects.fail(
            Failure(task_id, token, "builtins.RuntimeError", f"fail {round_}", delay=0), f"f{round_}"
        )
        written.append(f"fail {round_}")
        check(task_id, written)
        token = claim(task_id, f"s{round_}")
        failure = Failure(task_id, token, "builtins.RuntimeError", "nap", kind="snooze", delay=0)
        assert Task.objects.fail(failure, f"s{round_}")
        check(task_id, written)  # a snooze writes no entry and drops none
        token = claim(task_id, f"h{round_}")
        assert Task.objects.hand_back(f"h{round_}", [(task_id, token)]) == {(task_id, token)}
        written.append(reason)
        check(task_id, written)
        token = claim(task_id, f"u{round_}", start=False)
        assert Task.objects.hand_back(f"u{round_}", [(task_id, token)]) == {(task_id, token)}
        check(task_id, written)  # an unstarted claim handed back: no entry
        claim(task_id, f"c{round_}")
        Task.objects.filter(pk=task_id).update(expires_at=timezone.now() - dt.timedelta(seconds=5))
        assert [r.id for r in Task.objects.recover_expired()] == [task_id]
        written.append(Task.objects.get(pk=task_id).errors[-1]["message"])
        check(task_id, written)
    assert Task.objects.get(pk=task_id).status == "READY"
    BulkOperation.objects.request("discard", {"queue": QUEUE})
    BulkRunner().run_until_idle()
    task = Task.objects.get(pk=task_id)
    assert (task.status, task.errors[-1]["kind"]) == ("FAILED", "discard")
    written.append(task.errors[-1]["message"])
    check(task_id, written)
    assert task.errors_dropped == 24 + 1 - MAX_ERRORS
