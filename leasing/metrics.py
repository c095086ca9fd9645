"""Metrics, exported in the Prometheus text format at ``/metrics``.

Two kinds: process-local instruments (prometheus-client counters and histograms updated where
the event happens: lease acquisition latency, rejected renewals, fencing rejections seen by the
API), and cluster-wide figures read from the database at scrape time (leases by state, queue
depth and age, stuck tasks, workers alive, the counters every worker reports with its heartbeat,
recoveries and the time from a holder's last heartbeat to the requeue of its task). The latter
are the same whichever replica is scraped.

Access: a staff session, a bearer token from ``LEASING_API_TOKENS`` or ``LEASING_METRICS_TOKENS``,
or nothing at all when ``LEASING_METRICS_PUBLIC = True`` (for a scraper on a private network).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

acquisition_seconds = Histogram(
    "leasing_acquisition_seconds",
    "Time to acquire a lease through the API or lease(), including retries (this process).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
renewal_rejections = Counter(
    "leasing_renewal_rejections",
    "Renewals refused because the lease was lost (this process).",
)
fencing_rejections = Counter(
    "leasing_fencing_rejections",
    "Completions, failures or heartbeats refused by a compare-and-set, seen by this process's API.",
)

#: Collectors that read cluster-wide figures from the database at scrape time; apps add theirs.
DATABASE_COLLECTORS: list[Callable[[], Iterable[Metric]]] = []


@contextmanager
def acquisition_timer() -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        acquisition_seconds.observe(time.perf_counter() - started)


def lease_metrics() -> Iterable[Metric]:
    from leasing.views import state_counts

    family = GaugeMetricFamily("leasing_leases", "Leases by state (database).", labels=["state"])
    for state, count in state_counts().items():
        family.add_metric([state], count)
    yield family


DATABASE_COLLECTORS.append(lease_metrics)


class _DatabaseCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        for collector in DATABASE_COLLECTORS:
            yield from collector()


def _allowed(request: HttpRequest) -> bool:
    if getattr(settings, "LEASING_METRICS_PUBLIC", False):
        return True
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        offered = header[7:].strip().encode()
        tokens = [*getattr(settings, "LEASING_API_TOKENS", []), *getattr(settings, "LEASING_METRICS_TOKENS", [])]
        return any(token and hmac.compare_digest(offered, token.encode()) for token in tokens)
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_authenticated and user.is_staff)


def metrics_view(request: HttpRequest) -> HttpResponse:
    if not _allowed(request):
        response = HttpResponse("metrics: staff session or bearer token required\n", status=401)
        response["WWW-Authenticate"] = "Bearer"
        return response
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_DatabaseCollector())
    body = generate_latest(REGISTRY) + generate_latest(registry)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)


def scrape_values(text: str) -> dict[str, float]:
    """Parse an exposition into {"name{labels}": value} (for tests and the dashboard)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


__all__: list[Any] = ["acquisition_timer", "fencing_rejections", "metrics_view", "renewal_rejections"]
