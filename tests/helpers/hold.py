"""A holder process for the pause test: acquire, write through the fence, wait for orders."""

from __future__ import annotations

import sys

from leasing import StaleTokenError, lease
from leasing.fencing import fenced_update
from tests.helpers import emit
from tests.testapp.models import FencedRecord


def main(argv: list[str]) -> int:
    resource, ttl, key = argv[0], float(argv[1]), argv[2]
    record = FencedRecord.objects.filter(key=key)
    with lease(resource, ttl=ttl, timeout=10) as held:
        fenced_update(record, held.token, value=f"written by {held.token}")
        emit(acquired=True, token=held.token)
        sys.stdin.readline()  # the test pauses us (SIGSTOP), lets another take over, resumes us, then writes here
        detected = held.wait_lost(timeout=10)
        try:
            fenced_update(record, held.token, value=f"late write by {held.token}")
            outcome = "written"
        except StaleTokenError as exc:
            outcome = f"rejected: {exc}"
        emit(lost=detected, reason=held.lost_reason, write=outcome)
    emit(done=True)
    return 0
