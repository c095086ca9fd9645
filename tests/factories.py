"""factory-boy factories. Leases made here bypass the acquire statement, for state tests only."""

from __future__ import annotations

import datetime as dt

import factory
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from leasing.models import FENCE_SEQUENCE, Lease


def next_token() -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT nextval('{FENCE_SEQUENCE}')")
        return int(cursor.fetchone()[0])


class LeaseFactory(factory.django.DjangoModelFactory[Lease]):
    class Meta:
        model = Lease

    resource = factory.Sequence(lambda n: f"resource-{n}")
    holder = factory.Sequence(lambda n: f"host:1:{n:08x}")
    token = factory.LazyFunction(next_token)
    created_at = factory.LazyFunction(timezone.now)
    acquired_at = factory.LazyFunction(timezone.now)
    expires_at = factory.LazyAttribute(lambda o: o.acquired_at + dt.timedelta(seconds=30))

    class Params:
        expired = factory.Trait(expires_at=factory.LazyFunction(lambda: timezone.now() - dt.timedelta(seconds=1)))
        released = factory.Trait(released_at=factory.LazyFunction(timezone.now))
        renewed = factory.Trait(renewals=2, renewed_at=factory.LazyFunction(timezone.now))


class StaffFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"staff{n}")
    is_staff = True
    is_superuser = True
    password = factory.django.Password("pw")
