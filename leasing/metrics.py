"""Metrics, exported in the Prometheus text format at ``/metrics``.

Two kinds: process-local instruments (prometheus-client counters and histograms updated where
the event happens: lease acquisition latency, rejected renewals, fencing rejections seen by the
API), and cluster-wide figures read from the database at scrape time (leases by state, queue
depth and age, stuck tasks, workers alive, the counters every worker reports with its heartbeat,
recoveries and the time from a holder's last heartbeat to the requeue of its task). The latter
are the same whichever replica is scraped.

Several databases (leasing/routing.py): the database figures are read from every database that
holds our tables, each series labelled ``database="alias"``, and ``leasing_database_up{database}``
says which could be read (1) or not (0: unreachable, or refused the scrape); a database that is
down costs the scrape at most ``PROBE_TIMEOUT`` seconds, never a 500.

Access: a staff session with the view permissions of tasks and leases, a bearer token from
``LEASING_API_TOKENS`` (with those scopes) or ``LEASING_METRICS_TOKENS``, or nothing at all when
``LEASING_METRICS_PUBLIC = True`` (for a scraper on a private network).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connections
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from leasing.access import VIEW_LEASE, VIEW_TASK, Caller, api_tokens, declared, match_token
from leasing.bounds import without_jit
from leasing.routing import known_databases, using_database

logger = logging.getLogger("leasing.metrics")

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

    family = GaugeMetricFamily(
        "leasing_leases",
        "Leases by state (database); expired and released ones counted up to 10,000.",
        labels=["state"],
    )
    for state, count in state_counts().items():
        family.add_metric([state], count.value)
    yield family


DATABASE_COLLECTORS.append(lease_metrics)


#: Seconds a scrape waits for a database it has no open connection to before reporting it down
#: (libpq's connect_timeout: whole seconds, at least 2).
PROBE_TIMEOUT = 3


def _reachable(alias: str) -> bool:
    """Whether ``alias`` accepts a connection within PROBE_TIMEOUT (a server that drops packets
    would otherwise hold the scrape for the OS's TCP timeout). An open connection of this thread
    counts as reachable; the scrape itself tells otherwise."""
    wrapper: Any = connections[alias]  # PostgreSQL's wrapper: its Database is psycopg
    if wrapper.connection is not None:
        return True
    params = {**wrapper.get_connection_params(), "connect_timeout": PROBE_TIMEOUT}
    try:
        wrapper.Database.connect(**params).close()
    except wrapper.Database.Error as exc:
        logger.warning("metrics: database %s is unreachable: %s", alias, str(exc).splitlines()[0] if str(exc) else exc)
        return False
    return True


def database_metrics() -> Iterable[Metric]:
    """Every database collector's families, read from each database, merged and labelled."""
    up = GaugeMetricFamily("leasing_database_up", "Whether the scrape could read this database.", labels=["database"])
    merged: dict[str, Metric] = {}
    for alias in known_databases():
        families: list[Metric] = []
        try:
            if _reachable(alias):
                with using_database(alias):
                    families = [family for collector in DATABASE_COLLECTORS for family in collector()]
            readable = bool(families)
        except DatabaseError as exc:
            logger.warning("metrics: database %s could not be read: %s", alias, exc)
            readable = False
        up.add_metric([alias], 1 if readable else 0)
        for family in families:
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            target.samples.extend(s._replace(labels={"database": alias, **s.labels}) for s in family.samples)
    yield up
    yield from merged.values()


class _DatabaseCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        yield from database_metrics()


#: What a scrape reads: task and lease figures. A staff session needs both view permissions, an
#: API token both scopes; a token from LEASING_METRICS_TOKENS reads metrics and nothing else.
METRICS_PERMISSIONS = (VIEW_TASK, VIEW_LEASE)


def _access(request: HttpRequest) -> int:
    """200 (allowed), 401 (no or unknown credentials) or 403 (known, but without the permissions)."""
    if getattr(settings, "LEASING_METRICS_PUBLIC", False):
        return 200
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        offered = header[7:].strip()
        if match_token(offered, [t for t in getattr(settings, "LEASING_METRICS_TOKENS", []) if t]) is not None:
            return 200
        tokens = api_tokens()
        token = match_token(offered, tokens)
        if token is None:
            return 401
        return 200 if Caller("token", scopes=tokens[token]).has_perms(METRICS_PERMISSIONS) else 403
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return 401
    if not (user.is_active and user.is_staff and user.has_perms(METRICS_PERMISSIONS)):
        return 403
    return 200


def metrics_view(request: HttpRequest) -> HttpResponse:
    status = _access(request) if request.method in ("GET", "HEAD") else 405
    if status == 405:
        return HttpResponseNotAllowed(["GET", "HEAD"])
    if status == 403:
        return HttpResponse(f"metrics: needs {' and '.join(METRICS_PERMISSIONS)}\n", status=403)
    if status == 401:
        response = HttpResponse("metrics: staff session or bearer token required\n", status=401)
        response["WWW-Authenticate"] = "Bearer"
        return response
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_DatabaseCollector())
    with without_jit():
        body = generate_latest(REGISTRY) + generate_latest(registry)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)


declared(metrics_view, {"GET": METRICS_PERMISSIONS}, head=True)


def scrape_values(text: str) -> dict[str, float]:
    """Parse an exposition into {"name{labels}": value} (for tests and the dashboard)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


__all__: list[Any] = ["acquisition_timer", "fencing_rejections", "metrics_view", "renewal_rejections"]
