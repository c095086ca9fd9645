"""Admin and staff pages for leases."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from leasing.models import Lease
from leasing.views import state_counts
from tests.factories import LeaseFactory, StaffFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client: Client) -> Client:
    client.force_login(StaffFactory.create())
    return client


@pytest.mark.parametrize("state", ["active", "renewed", "expired", "released"])
def test_state_pages_list_only_their_leases(staff_client: Client, state: str) -> None:
    leases = {
        "active": LeaseFactory.create(resource="is-active"),
        "renewed": LeaseFactory.create(resource="is-renewed", renewed=True),
        "expired": LeaseFactory.create(resource="is-expired", expired=True),
        "released": LeaseFactory.create(resource="is-released", released=True),
    }
    response = staff_client.get(reverse("leasing:lease-state", args=[state]))
    assert response.status_code == 200
    page = response.content.decode()
    expected = {"active": {"active", "renewed"}}.get(state, {state})
    for name, lease in leases.items():
        assert (lease.resource in page) == (name in expected), name
    counts = response.context["counts"]
    assert {name: (c.value, c.capped) for name, c in counts.items()} == {
        "active": (2, False),
        "renewed": (1, False),
        "expired": (1, False),
        "released": (1, False),
    }


def test_released_and_expired_leases_are_counted_up_to_the_cap(staff_client: Client) -> None:
    """Released and expired leases pile up; their counts stop at the cap and say so ("3+" here)."""
    for n in range(4):
        LeaseFactory.create(resource=f"gone-{n}", released=True)
        LeaseFactory.create(resource=f"left-{n}", expired=True)
    LeaseFactory.create(resource="held")
    counts = state_counts(cap=3)
    assert {name: str(c) for name, c in counts.items()} == {
        "active": "1",
        "renewed": "0",
        "expired": "3+",
        "released": "3+",
    }
    assert not counts["renewed"] and counts["active"]


def test_the_tabs_split_every_lease_once_and_held_ones_show_a_live_dot(staff_client: Client) -> None:
    LeaseFactory.create(resource="is-active")
    LeaseFactory.create(resource="is-renewed", renewed=True)
    LeaseFactory.create(resource="is-expired", expired=True)
    LeaseFactory.create(resource="is-released", released=True)
    tabs: dict[str, set[str]] = {}
    for state in ("active", "expired", "released"):
        response = staff_client.get(reverse("leasing:lease-state", args=[state]))
        page = response.content.decode()
        nav = page.split('<nav class="tabs"', 1)[1].split("</nav>", 1)[0]
        assert [label for label in ("Held", "Expired", "Released", "Renewed") if f">\n      {label}<" in nav] == [
            "Held",
            "Expired",
            "Released",
        ]
        tabs[state] = {r for r in ("is-active", "is-renewed", "is-expired", "is-released") if r in page}
        assert page.count('class="live-dot"') == (2 if state == "active" else 0)
    seen = [r for rows in tabs.values() for r in rows]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 4  # each lease in exactly one tab
    renewed = staff_client.get(reverse("leasing:lease-state", args=["renewed"])).content.decode()
    assert "is-renewed" in renewed and "is-active" not in renewed and 'aria-current="page">\n      Held<' in renewed


def test_unknown_state_is_404(staff_client: Client) -> None:
    assert staff_client.get("/leases/bogus/").status_code == 404


def test_pages_are_staff_only(client: Client) -> None:
    url = reverse("leasing:lease-list")
    assert client.get(url).status_code == 302  # to the login page
    user = get_user_model().objects.create_user("plain", password="pw")
    client.force_login(user)
    assert client.get(url).status_code == 302


def test_admin_lists_filters_and_searches(staff_client: Client) -> None:
    LeaseFactory.create(resource="jobs:alpha", holder="web-1")
    LeaseFactory.create(resource="jobs:beta", expired=True)
    url = reverse("admin:leasing_lease_changelist")
    page = staff_client.get(url).content.decode()
    assert "jobs:alpha" in page
    assert "jobs:beta" in page
    expired_only = staff_client.get(url, {"state": "expired"}).content.decode()
    assert "jobs:beta" in expired_only
    assert "jobs:alpha" not in expired_only
    searched = staff_client.get(url, {"q": "web-1"}).content.decode()
    assert "jobs:alpha" in searched
    assert "jobs:beta" not in searched


def test_admin_revoke_action_ends_the_lease_and_the_next_grant_gets_a_new_token(staff_client: Client) -> None:
    grant = Lease.objects.acquire("jobs:alpha", "web-1", ttl=60)
    assert grant is not None
    lease = Lease.objects.get(resource="jobs:alpha")
    response = staff_client.post(
        reverse("admin:leasing_lease_changelist"),
        {"action": "revoke", "_selected_action": [lease.pk]},
        follow=True,
    )
    assert response.status_code == 200
    assert "Revoked 1 active lease" in response.content.decode()
    assert Lease.objects.renew("jobs:alpha", "web-1", grant.token, ttl=60) is None
    taken = Lease.objects.acquire("jobs:alpha", "web-2", ttl=60)
    assert taken is not None
    assert taken.token > grant.token


def test_admin_offers_no_hand_made_leases(staff_client: Client) -> None:
    assert staff_client.get(reverse("admin:leasing_lease_add")).status_code == 403


def test_the_overview_counts_leases_as_the_tabs_do(staff_client: Client) -> None:
    LeaseFactory.create(resource="is-active")
    LeaseFactory.create(resource="is-renewed", renewed=True)
    LeaseFactory.create(resource="is-expired", expired=True)
    response = staff_client.get("/dashboard/")
    assert [(name, label, str(count)) for name, label, count in response.context["lease_cards"]] == [
        ("active", "Held", "2"),
        ("expired", "Expired", "1"),
        ("released", "Released", "0"),
    ]
    assert '<div class="l">Renewed</div>' not in response.content.decode()
