"""Staff-only HTML pages listing leases by state."""

from __future__ import annotations

from django.db.models import Count, Q
from django.db.models.functions import Now
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from leasing.access import VIEW_LEASE, staff_page
from leasing.models import Lease
from leasing.pagination import CappedPaginator

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


def state_counts() -> dict[str, int]:
    """Counts of leases by state in one aggregate query."""
    live = Q(released_at__isnull=True)
    return Lease.objects.aggregate(
        active=Count("pk", filter=live & Q(expires_at__gt=Now())),
        renewed=Count("pk", filter=live & Q(expires_at__gt=Now(), renewals__gt=0)),
        expired=Count("pk", filter=live & Q(expires_at__lte=Now())),
        released=Count("pk", filter=Q(released_at__isnull=False)),
    )


@staff_page(GET=[VIEW_LEASE])
def lease_list(request: HttpRequest, state: str = "active") -> HttpResponse:
    if state not in STATES:
        raise Http404(f"unknown lease state {state!r}")
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
