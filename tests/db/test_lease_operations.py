"""Each lease operation, its failure cases, and the statements it costs."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import transaction

from leasing.models import Grant, Lease
from tests.factories import LeaseFactory
from tests.helpers import db_now, wait_until

pytestmark = pytest.mark.django_db


def test_acquire_creates_a_grant_timed_by_the_database_clock(holder_id: str) -> None:
    before = db_now()
    grant = Lease.objects.acquire("jobs:nightly", holder_id, ttl=30)
    after = db_now()

    assert isinstance(grant, Grant)
    assert grant.resource == "jobs:nightly"
    assert grant.holder == holder_id
    assert before <= grant.acquired_at <= after
    assert abs(grant.expires_at - grant.acquired_at - dt.timedelta(seconds=30)) < dt.timedelta(milliseconds=5)
    row = Lease.objects.get(resource="jobs:nightly")
    assert (row.token, row.renewals, row.transitions, row.released_at) == (grant.token, 0, 0, None)


def test_acquire_accepts_a_timedelta_and_rejects_a_non_positive_ttl(holder_id: str) -> None:
    grant = Lease.objects.acquire("r", holder_id, ttl=dt.timedelta(milliseconds=1500))
    assert grant is not None
    assert abs(grant.expires_at - grant.acquired_at - dt.timedelta(seconds=1.5)) < dt.timedelta(milliseconds=5)
    with pytest.raises(ValueError, match="positive"):
        Lease.objects.acquire("r2", holder_id, ttl=0)


def test_acquire_of_a_live_lease_fails_for_everyone_including_its_holder(holder_id: str, other_holder_id: str) -> None:
    first = Lease.objects.acquire("r", holder_id, ttl=30)
    assert first is not None
    assert Lease.objects.acquire("r", other_holder_id, ttl=30) is None
    assert Lease.objects.acquire("r", holder_id, ttl=30) is None  # renew is for that
    assert Lease.objects.get(resource="r").token == first.token


def test_acquire_takes_over_an_expired_lease_with_a_larger_token(holder_id: str, other_holder_id: str) -> None:
    first = Lease.objects.acquire("r", holder_id, ttl=0.05)
    assert first is not None
    second = wait_until(lambda: Lease.objects.acquire("r", other_holder_id, ttl=30), what="expiry")
    assert second.token > first.token
    assert second.acquired_at >= first.expires_at
    row = Lease.objects.get(resource="r")
    assert (row.holder, row.transitions, row.renewals) == (other_holder_id, 1, 0)


def test_acquire_after_release_gets_a_new_token_and_counts_only_holder_changes(
    holder_id: str, other_holder_id: str
) -> None:
    first = Lease.objects.acquire("r", holder_id, ttl=30)
    assert first is not None
    assert Lease.objects.release("r", holder_id, first.token)
    again = Lease.objects.acquire("r", holder_id, ttl=30)
    assert again is not None and again.token > first.token
    assert Lease.objects.get(resource="r").transitions == 0  # same holder: no change of hands
    assert Lease.objects.release("r", holder_id, again.token)
    third = Lease.objects.acquire("r", other_holder_id, ttl=30)
    assert third is not None and third.token > again.token
    assert Lease.objects.get(resource="r").transitions == 1


def test_tokens_come_from_one_sequence_and_survive_deleting_the_row(holder_id: str) -> None:
    first = Lease.objects.acquire("r", holder_id, ttl=30)
    assert first is not None
    Lease.objects.filter(resource="r").delete()
    again = Lease.objects.acquire("r", holder_id, ttl=30)
    other = Lease.objects.acquire("s", holder_id, ttl=30)
    assert again is not None and other is not None
    assert first.token < again.token < other.token


def test_renew_extends_from_now_and_keeps_the_token(holder_id: str) -> None:
    grant = Lease.objects.acquire("r", holder_id, ttl=5)
    assert grant is not None
    renewed = Lease.objects.renew("r", holder_id, grant.token, ttl=60)
    assert renewed is not None
    assert renewed.token == grant.token
    assert renewed.acquired_at == grant.acquired_at
    assert renewed.expires_at > grant.expires_at
    row = Lease.objects.get(resource="r")
    assert row.renewals == 1
    assert row.renewed_at is not None
    assert abs(row.expires_at - row.renewed_at - dt.timedelta(seconds=60)) < dt.timedelta(milliseconds=5)


@pytest.mark.parametrize("wrong", ["holder", "token", "resource"])
def test_renew_with_a_wrong_holder_token_or_resource_changes_nothing(holder_id: str, wrong: str) -> None:
    grant = Lease.objects.acquire("r", holder_id, ttl=30)
    assert grant is not None
    args: dict[str, Any] = {"resource": "r", "holder": holder_id, "token": grant.token}
    args[wrong] = {"holder": "someone-else", "token": grant.token + 1000, "resource": "nope"}[wrong]
    assert Lease.objects.renew(args["resource"], args["holder"], args["token"], ttl=60) is None
    row = Lease.objects.get(resource="r")
    assert (row.expires_at, row.renewals) == (grant.expires_at, 0)


def test_renew_of_an_expired_or_released_lease_fails(holder_id: str) -> None:
    short = Lease.objects.acquire("short", holder_id, ttl=0.05)
    released = Lease.objects.acquire("released", holder_id, ttl=30)
    assert short is not None and released is not None
    assert Lease.objects.release("released", holder_id, released.token)
    assert Lease.objects.renew("released", holder_id, released.token, ttl=30) is None
    wait_until(lambda: Lease.objects.expired().filter(resource="short").exists(), what="expiry")
    assert Lease.objects.renew("short", holder_id, short.token, ttl=30) is None


def test_release_ends_the_lease_now_and_only_once(holder_id: str) -> None:
    grant = Lease.objects.acquire("r", holder_id, ttl=30)
    assert grant is not None
    assert Lease.objects.release("r", "someone-else", grant.token) is False
    assert Lease.objects.release("r", holder_id, grant.token + 1) is False
    assert Lease.objects.release("r", holder_id, grant.token) is True
    assert Lease.objects.release("r", holder_id, grant.token) is False
    row = Lease.objects.get(resource="r")
    assert row.released_at is not None
    assert abs(row.expires_at - row.released_at) < dt.timedelta(milliseconds=5)
    assert Lease.objects.released().filter(resource="r").exists()


def test_release_of_an_expired_lease_reports_it_was_lost(holder_id: str) -> None:
    grant = Lease.objects.acquire("r", holder_id, ttl=0.05)
    assert grant is not None
    wait_until(lambda: Lease.objects.expired().filter(resource="r").exists(), what="expiry")
    assert Lease.objects.release("r", holder_id, grant.token) is False


def test_expiry_is_judged_by_statement_time_even_inside_an_old_transaction(
    holder_id: str, other_holder_id: str
) -> None:
    # now() would stay frozen at the start of this transaction and never see the lease expire.
    grant = Lease.objects.acquire("r", holder_id, ttl=0.2)
    assert grant is not None
    with transaction.atomic():
        taken = wait_until(lambda: Lease.objects.acquire("r", other_holder_id, ttl=30), timeout=5, what="takeover")
    assert taken.token > grant.token


def test_is_current_and_revoke(holder_id: str, other_holder_id: str) -> None:
    grant = Lease.objects.acquire("r", holder_id, ttl=30)
    assert grant is not None
    assert Lease.objects.is_current("r", grant.token)
    assert not Lease.objects.is_current("r", grant.token - 1)
    assert Lease.objects.filter(resource="r").revoke() == 1
    assert not Lease.objects.is_current("r", grant.token)
    assert Lease.objects.renew("r", holder_id, grant.token, ttl=30) is None
    taken = Lease.objects.acquire("r", other_holder_id, ttl=30)
    assert taken is not None and taken.token > grant.token
    assert Lease.objects.filter(resource="missing").revoke() == 0


def test_state_querysets_partition_leases() -> None:
    active = LeaseFactory.create()
    renewed = LeaseFactory.create(renewed=True)
    expired = LeaseFactory.create(expired=True)
    released = LeaseFactory.create(released=True)

    def names(qs: object) -> set[str]:
        return set(qs.values_list("resource", flat=True))  # type: ignore[attr-defined]

    assert names(Lease.objects.active()) == {active.resource, renewed.resource}
    assert names(Lease.objects.renewed()) == {renewed.resource}
    assert names(Lease.objects.expired()) == {expired.resource}
    assert names(Lease.objects.released()) == {released.resource}
    assert names(Lease.objects.held_by(active.holder)) == {active.resource}
    assert [lease.state for lease in (active, renewed, expired, released)] == [
        "active",
        "renewed",
        "expired",
        "released",
    ]


def test_metadata_is_stored_with_the_grant(holder_id: str) -> None:
    Lease.objects.acquire("r", holder_id, ttl=30, metadata={"job": 42})
    assert Lease.objects.get(resource="r").metadata == {"job": 42}


def test_hot_paths_are_one_statement_each(holder_id: str, django_assert_num_queries: object) -> None:
    with django_assert_num_queries(1):  # type: ignore[operator]
        grant = Lease.objects.acquire("r", holder_id, ttl=30)
    assert grant is not None
    with django_assert_num_queries(1):  # type: ignore[operator]
        assert Lease.objects.renew("r", holder_id, grant.token, ttl=30) is not None
    with django_assert_num_queries(1):  # type: ignore[operator]
        assert Lease.objects.release("r", holder_id, grant.token)
    with django_assert_num_queries(1):  # type: ignore[operator]
        assert Lease.objects.acquire("r", "other", ttl=30) is not None


def expire(resource: str) -> None:
    Lease.objects.filter(resource=resource).update(expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc))


def test_a_semaphore_grants_distinct_slots_up_to_its_limit_then_nothing() -> None:
    grants = [Lease.objects.acquire_slot("pool", f"h{i}", ttl=30, limit=3) for i in range(4)]
    assert grants[3] is None
    taken = [g for g in grants if g is not None]
    assert sorted(g.resource for g in taken) == ["pool#0", "pool#1", "pool#2"]
    assert sorted(g.token for g in taken) == [g.token for g in taken]  # one sequence, in grant order
    assert sorted(Lease.objects.slots("pool").active().values_list("holder", flat=True)) == ["h0", "h1", "h2"]
    # A released slot and an expired slot are free again, with larger tokens.
    assert Lease.objects.release(taken[1].resource, "h1", taken[1].token)
    again = Lease.objects.acquire_slot("pool", "h9", ttl=30, limit=3)
    assert again is not None and again.resource == taken[1].resource and again.token > max(g.token for g in taken)
    expire(taken[0].resource)
    late = Lease.objects.acquire_slot("pool", "h8", ttl=30, limit=3)
    assert late is not None and late.resource == taken[0].resource
    assert Lease.objects.acquire_slot("pool", "h7", ttl=30, limit=3) is None
    # The slot is a plain lease: its holder renews and releases it by its own name and token.
    assert Lease.objects.renew(late.resource, "h8", late.token, ttl=30) is not None
    assert not Lease.objects.release(late.resource, "h0", taken[0].token)  # the old holder is fenced off


def test_a_larger_limit_adds_slots_and_a_smaller_one_uses_only_the_lower_ones() -> None:
    first = Lease.objects.acquire_slot("pool", "a", ttl=30, limit=1)
    assert first is not None and first.resource == "pool#0"
    assert Lease.objects.acquire_slot("pool", "b", ttl=30, limit=1) is None
    wider = Lease.objects.acquire_slot("pool", "b", ttl=30, limit=2)
    assert wider is not None and wider.resource == "pool#1"


@pytest.mark.parametrize("limit", [0, -1])
def test_a_semaphore_without_slots_is_refused(limit: int) -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        Lease.objects.acquire_slot("pool", "a", ttl=30, limit=limit)
    assert not Lease.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_lease_context_manager_holds_one_slot_and_releases_it() -> None:
    from leasing import LeaseAcquisitionError, lease

    with lease("pool", limit=2, ttl=5, timeout=0) as one, lease("pool", limit=2, ttl=5, timeout=0) as two:
        assert {one.grant.resource, two.grant.resource} == {"pool#0", "pool#1"}
        one.check()
        with pytest.raises(LeaseAcquisitionError, match="all 2 slots of 'pool'"), lease("pool", limit=2, timeout=0):
            pass
    assert not Lease.objects.slots("pool").active().exists()
    with pytest.raises(ValueError, match="limit must be"):
        lease("pool", limit=0)
