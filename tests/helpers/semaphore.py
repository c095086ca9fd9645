"""Contend for the slots of one counting semaphore; record every grant with its validity in database time.

Run by the race test as 8 processes (``tests.helpers.child semaphore NAME LIMIT SECONDS SEED``).
Each grant is a dict (slot, holder, token, start, end): [start, end) is when the database considered
it valid, from acquire to release, or to its last expiry when the holder walked away or froze.
"""

from __future__ import annotations

import random
import time
from typing import Any

from django.db import connection

from leasing.holder import default_holder_id
from leasing.models import Lease, release_on

TTL = 0.3


def contend(resource: str, limit: int, duration: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    holder = default_holder_id()
    grants: list[dict[str, Any]] = []
    end_at = time.monotonic() + duration
    while time.monotonic() < end_at:
        grant = Lease.objects.acquire_slot(resource, holder, ttl=TTL, limit=limit)
        if grant is None:
            time.sleep(rng.random() * 0.005)
            continue
        record = {"slot": grant.resource, "holder": holder, "token": grant.token, "start": grant.acquired_at}
        end = grant.expires_at
        time.sleep(rng.random() * 0.02)  # hold it for a while: holders must overlap to test the bound
        if rng.random() < 0.5:
            renewed = Lease.objects.renew(grant.resource, holder, grant.token, ttl=TTL)
            if renewed is not None:
                end = renewed.expires_at
        if rng.random() < 0.85:
            released = release_on(connection, grant.resource, holder, grant.token)
            if released is not None:
                end = released.expires_at
        # else: walk away and let it expire; the slot is free again only on the database clock.
        record["end"] = end
        grants.append(record)
    return grants


def main(argv: list[str]) -> int:
    from tests.helpers import emit

    resource, limit, seconds, seed = argv[0], int(argv[1]), float(argv[2]), int(argv[3])
    emit(ready=True)
    for entry in contend(resource, limit, seconds, seed):
        emit(**entry)
    emit(done=True)
    return 0
