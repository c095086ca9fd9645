"""The order pytest-xdist hands out the suite's files in (``--dist loadfile`` sends whole files in
collection order): the longest first, so that the run does not end on one worker still in a file of
minutes while the others wait. A clean-clone run ended that way: the last 2 % of the Django 5.2 leg
took 6 of its 34 minutes, the install test (76-107 s) collected last.

Only the order of files changes; the tests of a file keep theirs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Files of a minute or more each (test time measured this stop), ahead of everything.
LONGEST = (
    "tests/install/",
    "tests/e2e/",
    "tests/db/test_lease_counts_every_order.py",
    "tests/db/test_finished_lists_agree_with_both_tables.py",
    "tests/db/test_api_fuzz.py",
    "tests/db/test_edge_input.py",
    "tests/db/test_task_operations.py",
    "tests/db/test_concurrency_keys_at_scale.py",
    # a test of about a minute each in a clean-clone run of stop 62 (the 5.2 leg's slowest 30)
    "tests/db/test_finished_lists_walk.py",
    "tests/db/test_embedded_server.py",
    "tests/db/test_page_plans.py",
    "tests/concurrency/test_finished_lists_while_the_mover_runs.py",
    "tests/concurrency/test_scheduler_processes.py",
    "tests/concurrency/test_sigkill_accounting.py",
    "tests/concurrency/test_prune_while_draining.py",
    "tests/concurrency/test_rate_limit_processes.py",
    "tests/concurrency/test_pgbouncer.py",
    "tests/concurrency/test_demo_features.py",
    "tests/concurrency/test_fair_cursor_across_lives.py",
    "tests/concurrency/test_fair_rate_keys_processes.py",
    "tests/concurrency/test_workflow_processes.py",
    "tests/concurrency/test_bulk_processes.py",
)
#: Then the lanes of real processes (seconds to a minute or two a file), then the rest.
PROCESSES = ("tests/concurrency/", "tests/celery/", "tests/monitoring/")


def rank(path: str) -> int:
    if path.startswith(LONGEST):
        return 0
    if path.startswith(PROCESSES):
        return 1
    return 2


def longest_first(items: Sequence[Any]) -> list[Any]:
    """``items`` with their files in :func:`rank` order, each file's tests in their own order."""
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], index)
    return sorted(items, key=lambda item: (rank(item.nodeid), first[item.nodeid.split("::", 1)[0]]))
