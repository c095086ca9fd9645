"""8 threads and 4 processes contend for the same few resources; no two grants may overlap."""

from __future__ import annotations

import itertools
import json
import threading
from collections import defaultdict
from contextlib import ExitStack
from typing import Any

import pytest
from django.db import connections

from tests.helpers import ensure_ended, iso_time, read_message, start_child
from tests.helpers.contend import contend

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

RESOURCES = ["alpha", "beta", "gamma"]
DURATION = 4.0


def grants_in(out: str) -> list[dict[str, Any]]:
    """The grants a child printed (its JSON lines with a token), their times read."""
    grants = []
    for line in out.splitlines():
        message = json.loads(line)
        if "token" in message:
            grants.append({**message, "start": iso_time(message["start"]), "end": iso_time(message["end"])})
    return grants


def test_no_two_grants_of_a_resource_overlap_and_tokens_grow() -> None:
    grants: list[dict[str, Any]] = []
    lock = threading.Lock()

    def run_thread(seed: int) -> None:
        try:
            mine = contend(RESOURCES, DURATION, 1000 + seed)
            with lock:
                grants.extend(mine)
        finally:
            connections.close_all()

    with ExitStack() as children:
        # Ended and their pipes closed whatever happens (a leaked pipe fails a later test).
        processes = [
            children.enter_context(ensure_ended(start_child("contend", ",".join(RESOURCES), str(DURATION), str(i))))
            for i in range(4)
        ]
        for proc in processes:
            assert read_message(proc).get("ready")  # a handshake: the children's start is waited for

        threads = [threading.Thread(target=run_thread, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)

        for proc in processes:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            grants += grants_in(out)

    by_resource: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for grant in grants:
        by_resource[grant["resource"]].append(grant)
    holders = {grant["holder"] for grant in grants}

    assert set(by_resource) == set(RESOURCES)
    assert len(holders) >= 6, "contenders in threads and processes should have won"
    assert len({grant["token"] for grant in grants}) == len(grants), "a token was granted twice"
    for resource, entries in by_resource.items():
        entries.sort(key=lambda g: g["start"])
        for before, after in itertools.pairwise(entries):
            assert after["start"] >= before["end"], f"{resource}: {before} overlaps {after}"
            assert after["token"] > before["token"], f"{resource}: token went backwards"
    # Enough traffic to prove something, without depending on how fast the machine is today.
    assert len(grants) >= 100, f"too little contention to prove anything ({len(grants)} grants)"
    handoffs = sum(
        1
        for entries in by_resource.values()
        for before, after in itertools.pairwise(entries)
        if before["holder"] != after["holder"]
    )
    assert handoffs >= 30, f"only {handoffs} changes of holder"


def test_a_semaphore_of_three_raced_by_eight_processes_never_has_more_than_three_holders() -> None:
    """Issue 12: a counting semaphore on the lease core; checked on the database clock."""
    limit = 3
    with ExitStack() as children:
        processes = [
            children.enter_context(ensure_ended(start_child("semaphore", "pool", str(limit), str(DURATION), str(i))))
            for i in range(8)
        ]
        # Eight interpreters importing Django at once beside the other tests' workers: their start
        # is waited for (a readiness handshake, not a deadline the race needs).
        for proc in processes:
            assert read_message(proc, timeout=120).get("ready")
        outputs = [proc.communicate(timeout=60) for proc in processes]
    grants: list[dict[str, Any]] = []
    for proc, (out, err) in zip(processes, outputs, strict=True):
        assert proc.returncode == 0, err
        grants += grants_in(out)
    assert len(grants) >= 100, f"too little contention to prove anything ({len(grants)} grants)"
    assert {grant["slot"] for grant in grants} == {f"pool#{k}" for k in range(limit)}
    assert len({grant["token"] for grant in grants}) == len(grants), "a token was granted twice"
    # Sweep the grants' validity intervals in database time: never more than `limit` live at once.
    events = sorted([(g["start"], 1) for g in grants] + [(g["end"], -1) for g in grants], key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    assert peak <= limit, f"{peak} holders at once"
    assert peak == limit, "the slots were never all in use: the race proved nothing"
    by_slot: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for grant in grants:
        by_slot[grant["slot"]].append(grant)
    for slot, entries in by_slot.items():
        entries.sort(key=lambda g: g["start"])
        for before, after in itertools.pairwise(entries):
            assert after["start"] >= before["end"], f"{slot}: {before} overlaps {after}"
            assert after["token"] > before["token"], f"{slot}: token went backwards"
