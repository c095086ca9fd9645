"""JSON API for leases (the seed's lease routes, with real status codes)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.urls import path

from leasing import metrics
from leasing.access import CHANGE_LEASE, VIEW_LEASE
from leasing.conf import get_settings
from leasing.http import ApiError, Body, api_view, iso, keyset_page, query_id, query_text, routed
from leasing.models import HELD_STATES, Grant, Lease
from leasing.routing import lease_database

STATES = ("active", "expired", "renewed", "released")
MAX_TTL = 86_400.0


def lease_json(lease: Lease) -> dict[str, Any]:
    return {
        "id": lease.pk,
        "resource": lease.resource,
        "holder": lease.holder,
        "token": lease.token,
        "state": lease.state,
        "created_at": iso(lease.created_at),
        "acquired_at": iso(lease.acquired_at),
        "renewed_at": iso(lease.renewed_at),
        "released_at": iso(lease.released_at),
        "expires_at": iso(lease.expires_at),
        "renewals": lease.renewals,
        "transitions": lease.transitions,
        "metadata": lease.metadata,
    }


def grant_json(grant: Grant) -> dict[str, Any]:
    return {
        "resource": grant.resource,
        "holder": grant.holder,
        "token": grant.token,
        "acquired_at": iso(grant.acquired_at),
        "expires_at": iso(grant.expires_at),
    }


def _listing(request: HttpRequest, state: str | None) -> tuple[int, dict[str, Any]]:
    queryset = Lease.objects.all() if state is None else getattr(Lease.objects, state)()
    return keyset_page(request, queryset, "leases", lease_json)


def _conflict(resource: str, message: str) -> ApiError:
    current = Lease.objects.filter(resource=resource).first()
    extra: dict[str, Any] = {}
    if current is not None and current.state in HELD_STATES:
        extra = {"holder": current.holder, "expires_at": iso(current.expires_at)}
    return ApiError(409, message, **extra)


@api_view(GET=[VIEW_LEASE], POST=[CHANGE_LEASE])
def leases(request: HttpRequest) -> tuple[int, Any]:
    if request.method == "GET":
        state = request.GET.get("state") or None
        if state and state not in STATES:
            raise ApiError(400, f"state must be one of {', '.join(STATES)}", "state")
        return _listing(request, state)
    body = Body(request)
    body.only("resource", "holder", "ttl", "metadata")
    resource = body.text("resource")
    holder = body.text("holder", max_length=200)
    ttl = body.number("ttl", required=False, low=0, high=MAX_TTL, default=get_settings().DEFAULT_TTL)
    metadata = body.mapping("metadata")
    with routed(request, lease_database(resource), f"lease {resource!r}"):
        with metrics.acquisition_timer():
            grant = Lease.objects.acquire(resource, holder, ttl, metadata=metadata)
        if grant is None:
            raise _conflict(resource, "the lease is held by another holder (or already by you: renew it)")
        return 201, {"grant": grant_json(grant), "lease": lease_json(Lease.objects.get(resource=resource))}


def _state_view(state: str) -> Any:
    @api_view(GET=[VIEW_LEASE])
    def view(request: HttpRequest) -> tuple[int, Any]:
        return _listing(request, state)

    view.__name__ = f"leases_{state}"
    return view


@api_view(PUT=[CHANGE_LEASE])
def renew(request: HttpRequest) -> tuple[int, Any]:
    body = Body(request)
    body.only("resource", "holder", "token", "ttl")
    resource = body.text("resource")
    holder = body.text("holder", max_length=200)
    token = body.whole("token", low=1, high=2**63 - 1)
    ttl = body.number("ttl", required=False, low=0, high=MAX_TTL, default=get_settings().DEFAULT_TTL)
    with routed(request, lease_database(resource), f"lease {resource!r}"):
        grant = Lease.objects.renew(resource, holder, token, ttl)
        if grant is None:
            if not Lease.objects.filter(resource=resource).exists():
                raise ApiError(404, f"no lease on {resource!r}")
            metrics.renewal_rejections.inc()
            raise _conflict(resource, "lease lost: expired, released, revoked or held by another holder")
        return 200, {"grant": grant_json(grant)}


def _lease_or_404(lease_id: int) -> Lease:
    lease = Lease.objects.filter(pk=lease_id).first() if 0 < lease_id < 2**63 else None
    if lease is None:
        raise ApiError(404, f"no lease with id {lease_id}")
    return lease


@api_view(GET=[VIEW_LEASE], DELETE=[CHANGE_LEASE])
def lease_detail(request: HttpRequest, lease_id: int) -> tuple[int, Any]:
    lease = _lease_or_404(lease_id)
    if request.method == "GET":
        return 200, {"lease": lease_json(lease)}
    body = Body(request, required=False)
    body.only("holder", "token")
    holder = body.text("holder", max_length=200, required=False) or query_text(request, "holder", max_length=200)
    token = body.whole("token", required=False, low=1, high=2**63 - 1) or query_id(request, "token")
    if not holder or token is None:
        raise ApiError(400, "holder and token are required (in the body or the query string)", "token")
    if not Lease.objects.release(lease.resource, holder, token):
        raise _conflict(lease.resource, "not released: the lease is no longer yours (expired, released or taken)")
    return 200, {"released": True, "lease": lease_json(Lease.objects.get(pk=lease_id))}


urlpatterns = [
    path("leases", leases, name="api-leases"),
    path("leases/renew", renew, name="api-lease-renew"),
    *[path(f"leases/{state}", _state_view(state), name=f"api-leases-{state}") for state in STATES],
    path("leases/<int:lease_id>", lease_detail, name="api-lease-detail"),
]
