"""Contend for a few resources and record every grant with its validity in database time.

Used by threads of the test process and, as ``python -m tests.helpers.contend``, by child
processes; each grant is a dict (resource, holder, token, start, end) where [start, end) is the
time the database considered it valid: from acquire to release, or to the last expiry when the
holder walked away without releasing.
"""

from __future__ import annotations

import random
import time
from typing import Any

from django.db import connection

from leasing.holder import default_holder_id
from leasing.models import Lease, release_on

TTL = 0.3


def contend(resources: list[str], duration: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    holder = default_holder_id()
    grants: list[dict[str, Any]] = []
    end_at = time.monotonic() + duration
    while time.monotonic() < end_at:
        resource = rng.choice(resources)
        grant = Lease.objects.acquire(resource, holder, ttl=TTL)
        if grant is None:
            continue
        record = {"resource": resource, "holder": holder, "token": grant.token, "start": grant.acquired_at}
        end = grant.expires_at
        if rng.random() < 0.5:
            renewed = Lease.objects.renew(resource, holder, grant.token, ttl=TTL)
            if renewed is not None:
                end = renewed.expires_at
        if rng.random() < 0.9:
            released = release_on(connection, resource, holder, grant.token)
            if released is not None:
                end = released.expires_at
        # else: walk away and let it expire; the next holder must wait for the database clock.
        record["end"] = end
        grants.append(record)
    return grants


def main(argv: list[str]) -> int:
    from tests.helpers import emit

    names, seconds, seed = argv[0].split(","), float(argv[1]), int(argv[2])
    emit(ready=True)
    for entry in contend(names, seconds, seed):
        emit(**entry)
    emit(done=True)
    return 0
