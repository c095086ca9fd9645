"""Typed settings with defaults, read from ``settings.LEASING`` (a dict) on every access."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from django.conf import settings


@dataclass(frozen=True, slots=True)
class LeasingSettings:
    #: Lease time-to-live in seconds when a call does not give one.
    DEFAULT_TTL: float = 30.0
    #: A holder renews every ``ttl * RENEW_FRACTION`` seconds ...
    RENEW_FRACTION: float = 1 / 3
    #: ... give or take this fraction of the interval, so replicas do not renew in lockstep.
    RENEW_JITTER: float = 0.1
    #: How long ``lease()`` keeps trying to acquire when no ``timeout`` is given (seconds).
    ACQUIRE_TIMEOUT: float = 10.0
    #: First and largest pause between acquisition attempts (capped exponential backoff, jittered).
    BACKOFF_INITIAL: float = 0.05
    BACKOFF_MAX: float = 2.0
    #: Pause of a standby in leader election between attempts to take over.
    ELECTION_RETRY_INTERVAL: float = 1.0
    #: Lease namespaces routed to database aliases: resource-name prefix -> alias (the longest
    #: matching prefix wins; others live in ``default``). See leasing/routing.py.
    DATABASES: dict[str, str] = field(default_factory=dict)


def get_settings() -> LeasingSettings:
    overrides: dict[str, Any] = dict(getattr(settings, "LEASING", {}) or {})
    known = {f.name for f in fields(LeasingSettings)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown LEASING settings: {', '.join(sorted(unknown))}")
    return LeasingSettings(**overrides)
