"""The local clock a holder uses to give up early.

A holder's local deadline must never let it believe it still holds a lease the database already
considers expired. ``time.monotonic()`` is CLOCK_MONOTONIC on Linux, which stops while the machine
(or the VM) is suspended: after a resume it would report that little time had passed, and a holder
would keep writing for up to a whole TTL after its lease ended. CLOCK_BOOTTIME keeps counting
through suspend, so it is used wherever the platform has it.
"""

from __future__ import annotations

import time

_CLOCK = getattr(time, "CLOCK_BOOTTIME", None)


def _boottime() -> float:
    return time.clock_gettime(_CLOCK)  # type: ignore[arg-type]


def _probe() -> bool:
    if _CLOCK is None:
        return False
    try:
        _boottime()
    except OSError:
        return False
    return True


#: Seconds on a clock that never goes backwards and keeps counting through suspend where possible.
monotonic = _boottime if _probe() else time.monotonic

#: Whether :func:`monotonic` counts through suspend (CLOCK_BOOTTIME) on this platform.
COUNTS_THROUGH_SUSPEND = monotonic is not time.monotonic
