from __future__ import annotations

import threading
from typing import Any

import pytest

from leasing.election import LeaderElection, Term
from leasing.models import Lease
from tests.helpers import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_leasing")]


class Candidate:
    """A replica: an election in a thread, recording the terms it served."""

    def __init__(self, name: str, log: list[tuple[str, str, int]], lock: threading.Lock) -> None:
        self.election = LeaderElection("singleton", ttl=1.0, holder=name, retry_interval=0.05)
        self.name = name
        self.log = log
        self.lock = lock
        self.thread = threading.Thread(target=self._run, name=name)

    def _lead(self, term: Term) -> None:
        with self.lock:
            self.log.append(("start", self.name, term.token))
        while not term.wait(0.05):
            pass
        with self.lock:
            self.log.append(("end", self.name, term.token))

    def _run(self) -> None:
        self.election.run(self._lead)


def test_one_leader_at_a_time_and_handover_on_stop() -> None:
    log: list[tuple[str, str, int]] = []
    lock = threading.Lock()
    candidates = [Candidate(f"replica-{i}", log, lock) for i in range(3)]
    for candidate in candidates:
        candidate.thread.start()
    try:
        for _ in range(3):
            leader = wait_until(lambda: next((c for c in candidates if c.election.is_leader), None), what="a leader")
            assert sum(c.election.is_leader for c in candidates) == 1
            leader.election.stop()
            leader.thread.join(10)
            assert not leader.thread.is_alive()
            candidates.remove(leader)
    finally:
        for candidate in candidates:
            candidate.election.stop()
            candidate.thread.join(10)

    # Terms never overlap: every start is followed by its own end before the next start.
    starts = [entry for entry in log if entry[0] == "start"]
    assert len(starts) == 3
    for index, entry in enumerate(log):
        expected = "start" if index % 2 == 0 else "end"
        assert entry[0] == expected
        if expected == "end":
            assert entry[1:] == log[index - 1][1:]
    tokens = [token for _, _, token in starts]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


def test_leader_steps_down_when_its_lease_is_revoked() -> None:
    ended = threading.Event()
    terms: list[int] = []

    def lead(term: Term) -> None:
        terms.append(term.token)
        while not term.wait(0.05):
            pass
        ended.set()

    election = LeaderElection("singleton", ttl=1.0, retry_interval=0.05)

    thread = threading.Thread(target=election.run, args=(lead,))
    thread.start()
    try:
        assert election.wait_for_leadership(10)
        Lease.objects.filter(resource="singleton").revoke()
        assert ended.wait(10), "leader kept running after losing its lease"
        # It stands by and wins again with a new token, since nobody else wants it.
        wait_until(lambda: len(terms) >= 2, what="second term")
        assert terms[1] > terms[0]
    finally:
        election.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_run_once_returns_false_while_another_leads() -> None:
    Lease.objects.acquire("singleton", "someone-else", ttl=30)
    calls: list[Any] = []
    assert LeaderElection("singleton").run_once(calls.append) is False
    assert calls == []
