"""A retry loop's bound moves with a stop (tasks/worker/session.py): a loop that began before the
stop request had one TTL to run, and kept it, so a worker cut off from its database outlived its
drain and its leases (a clean-clone run: the SIGTERM test of test_shutdown_under_faults.py)."""

from __future__ import annotations

from django.db import OperationalError

from leasing import clock
from tasks.worker.session import Session, retrying


def session() -> Session:
    return Session("w:1", "w", "default", ttl=3600.0, shutdown_grace=2.0, poll_interval=1.0)


def test_a_stop_requested_while_a_statement_is_retried_ends_the_retries_at_the_drain_deadline() -> None:
    s = session()
    calls: list[int] = []

    def cut_off() -> str:
        calls.append(1)
        if len(calls) == 1:
            # The stop comes while the statement is out; its drain deadline has passed by the time
            # the failure is seen.
            s.draining.set()
            s.drain_deadline = clock.monotonic() - 5.0
            raise OperationalError("server closed the connection unexpectedly")
        return "sent again"

    assert retrying("recording a start", s, cut_off) is None
    assert len(calls) == 1  # not retried for the rest of its TTL


def test_the_bound_set_at_the_start_still_holds_without_a_stop() -> None:
    s = session()
    assert not s.out_of_retries(s.retry_deadline())
    assert s.out_of_retries(clock.monotonic() - 1.0)  # its own bound passed
    s.hurry.set()
    assert s.out_of_retries(s.retry_deadline())  # a second stop ends it at once
