from __future__ import annotations

import pytest

from leasing import StaleTokenError
from leasing.fencing import fenced_update
from tests.testapp.models import FencedRecord

pytestmark = pytest.mark.django_db


def test_newer_or_equal_tokens_write_and_record_themselves() -> None:
    FencedRecord.objects.create(key="k")
    qs = FencedRecord.objects.filter(key="k")
    assert fenced_update(qs, 5, value="five") == 1
    assert fenced_update(qs, 5, value="five again") == 1
    assert fenced_update(qs, 9, value="nine") == 1
    row = qs.get()
    assert (row.fence_token, row.value) == (9, "nine")


def test_stale_token_is_rejected_and_changes_nothing() -> None:
    FencedRecord.objects.create(key="k", fence_token=10, value="new")
    with pytest.raises(StaleTokenError, match="written with token 10"):
        fenced_update(FencedRecord.objects.filter(key="k"), 7, value="old")
    assert FencedRecord.objects.get(key="k").value == "new"


def test_no_matching_row_is_reported_as_such() -> None:
    with pytest.raises(StaleTokenError, match="no row matched"):
        fenced_update(FencedRecord.objects.filter(key="missing"), 1, value="x")


def test_fenced_update_is_one_statement(django_assert_num_queries: object) -> None:
    FencedRecord.objects.create(key="k")
    with django_assert_num_queries(1):  # type: ignore[operator]
        fenced_update(FencedRecord.objects.filter(key="k"), 3, value="v")
