"""Rate limits per key in issue 25's test helpers: ``run_until_empty``
promises that a task run there "ends exactly as on a worker", with the worker's own statements. A
worker takes a rate-limited start through RATE_START_SQL (granted or handed back); the inline runner
sends START_SQL for every claim, so a rate-limited task run there takes no start of its key's window
and is never refused: the key's limit does not hold, and the real workers sharing the key do not
see those starts.

Found by breaker 32 (the bug hunt on issue 24's rate limits per key)."""

from __future__ import annotations

import pytest

from tasks.models import RateLimit, Task, TaskStatus
from tasks.testing import run_until_empty
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def test_run_until_empty_takes_rate_limited_starts_from_the_keys_window() -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 3, rate_key="b32-inline", rate_limit=(1, 60))
    run_until_empty()
    rows = list(Task.objects.filter(pk__in=ids).values_list("status", "attempts", "rate_refusals"))
    succeeded = [r for r in rows if r[0] == TaskStatus.SUCCESSFUL]
    key = RateLimit.objects.filter(key="b32-inline").first()
    assert len(succeeded) == 1, (
        f"{len(succeeded)} starts of a key limited to 1 per minute ran inline: {rows};"
        f" the key's row: {key and (key.grants, key.refusals)}"
    )
    assert key is not None and (key.grants, key.refusals) == (1, 2)
    assert sorted(r[2] for r in rows) == [0, 1, 1]
