"""Staff-only HTML pages listing leases by state."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from leasing.access import VIEW_LEASE, staff_page
from leasing.models import HELD_STATES, RESOURCE_VALUE, Lease
from leasing.pagination import COUNT_CAP, CappedPaginator, Count, bounded_count

STATES = ("active", "renewed", "expired", "released")
#: The tabs split every lease in three, each lease in one: held (unexpired, unreleased: renewed or
#: not), expired (its holder stopped renewing and never released it) and released. "renewed" (held
#: and renewed at least once) is a view inside "held", reached from it, not a tab beside it.
TABS = (("active", "Held"), ("expired", "Expired"), ("released", "Released"))
TITLES = {
    "active": "Held leases",
    "renewed": "Held leases renewed at least once",
    "expired": "Expired leases (not renewed in time, never released)",
    "released": "Released leases",
}
PAGE_SIZE = 50


def state_counts(cap: int = COUNT_CAP) -> dict[str, Count]:
    """Leases by state, none read beyond a bound. Held and renewed: one aggregate over the held leases
    (``leasing_lease_expires_idx`` from now on: a released lease's expiry is its release time, so what
    is held now, never the history). Expired and released leases pile up (abandoned resources, every
    grant ever released), so each is counted up to ``cap`` in its state's resource index:
    "10,000+" beyond."""
    # LeaseQuerySet.held: the expiry range alone. Through active(), PostgreSQL 15 ANDed the range with
    # a bitmap of leasing_lease_live_res_idx, every held *and expired* lease: 205,000 entries read
    # (857 buffers) to count 5,000 held leases beside 200,000 expired ones; now 5,000 rows, 69 buffers.
    held = Lease.objects.held().aggregate(
        active=models.Count("pk"), renewed=models.Count("pk", filter=Q(renewals__gt=0))
    )
    counts = {name: Count(value, False) for name, value in held.items()}
    counts["expired"] = bounded_count(Lease.objects.expired().order_by("resource"), cap)
    counts["released"] = bounded_count(Lease.objects.released().order_by("resource"), cap)
    return counts


@staff_page(GET=[VIEW_LEASE])
def lease_list(request: HttpRequest, state: str = "active") -> HttpResponse:
    if state not in STATES:
        raise Http404(f"unknown lease state {state!r}")
    if state in HELD_STATES:
        queryset = Lease.objects.held(renewed=state == "renewed").order_by(RESOURCE_VALUE, "pk")
    else:
        queryset = getattr(Lease.objects, state)().order_by("resource")
    page = CappedPaginator(queryset, PAGE_SIZE).get_page(request.GET.get("page"))
    return render(
        request,
        "leasing/lease_list.html",
        {
            "state": state,
            "tab": "active" if state == "renewed" else state,
            "tabs": TABS,
            "title": TITLES[state],
            "page": page,
            "counts": state_counts(),
        },
    )
